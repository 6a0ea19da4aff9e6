"""Train kvcache's small default model: a ~3M-parameter Llama on text shipped with Python itself.

Data (offline, licence-clean: Python Software Foundation License): the English documentation
topics of `pydoc_data.topics` and the source of the standard library's top-level modules. A
byte-level BPE tokenizer is trained on the same text with the `tokenizers` library. The model is
trained with Hugging Face `transformers` (a dev dependency) and saved as a standard checkpoint
folder, so `transformers` and `kvcache.load_model` both load it.

    .venv/bin/python scripts/train_default_model.py --out src/kvcache/default_model

Seeded; a rerun with the same Python, torch version and thread count gives the same weights.
It prints a progress bar with the loss, then held-out bits per byte against a unigram baseline
and a few greedy samples, and writes them to `training_report.json` in the output folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>",
                  "<|end|>"]


def load_documents(code_bytes: int) -> tuple[list[str], dict]:
    """The training text as documents: every pydoc topic, a few chat-shaped topic answers, and
    standard-library modules in name order until `code_bytes` of code."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = [topics[name] for name in sorted(topics)]
    chats = [
        f"<|user|>\nWhat is {name.replace('-', ' ')} in Python?<|end|>\n<|assistant|>\n"
        f"{topics[name].strip()[:600]}<|end|>\n"
        for name in sorted(topics)
    ]
    stdlib = sysconfig.get_paths()["stdlib"]
    code, used = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        if used >= code_bytes:
            break
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        code.append(text)
        used += len(text.encode("utf-8"))
    source = {
        "pydoc_topics": len(docs), "chat_examples": len(chats), "stdlib_modules": len(code),
        "python": platform.python_version(),
        "licence": "Python Software Foundation License (text shipped with CPython)",
    }
    return docs + chats + code, source


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> list[int]:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return ids


def unigram_bits(train_ids: list[int], held_ids: list[int], vocab_size: int) -> float:
    """Total bits of the held-out tokens under add-one-smoothed training token frequencies."""
    counts = [1] * vocab_size
    for token in train_ids:
        counts[token] += 1
    total = sum(counts)
    return -sum(math.log2(counts[t] / total) for t in held_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="src/kvcache/default_model", help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=700, help="optimizer steps (default 700)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size (default 1024)")
    parser.add_argument("--code-bytes", type=int, default=1_500_000,
                        help="bytes of standard-library code in the data (default 1.5 MB)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    texts, source = load_documents(args.code_bytes)
    order = list(range(len(texts)))
    rng.shuffle(order)
    held_count = max(1, len(texts) // 20)
    held = [texts[i] for i in order[:held_count]]
    train = [texts[i] for i in order[held_count:]]
    print(f"data: {len(train)} training and {len(held)} held-out documents, "
          f"{sum(len(t.encode()) for t in train):,} / {sum(len(t.encode()) for t in held):,} bytes",
          file=sys.stderr)

    tokenizer = train_tokenizer(train, args.vocab)
    eos_id = tokenizer.token_to_id("<|eos|>")
    train_ids = encode_stream(tokenizer, train, eos_id)
    held_ids = encode_stream(tokenizer, held, eos_id)
    held_bytes = sum(len(t.encode("utf-8")) for t in held)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.token_to_id("<|bos|>"),
        eos_token_id=eos_id, pad_token_id=tokenizer.token_to_id("<|pad|>"),
    )
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters; {len(train_ids):,} training tokens", file=sys.stderr)

    data = torch.tensor(train_ids, dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", unit="step", file=sys.stderr)
    for step in bar:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=generator)
        batch = torch.stack([data[s: s + args.seq_len + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step):.1e}")
    train_seconds = time.perf_counter() - started

    model.eval()
    held_nats, held_tokens = 0.0, 0
    with torch.no_grad():
        held_tensor = torch.tensor(held_ids, dtype=torch.long)
        for start in range(0, len(held_ids) - 1, args.seq_len):
            chunk = held_tensor[start: start + args.seq_len + 1]
            if len(chunk) < 2:
                break
            logits = model(input_ids=chunk[None, :-1]).logits[0]
            held_nats += torch.nn.functional.cross_entropy(
                logits, chunk[1:], reduction="sum").item()
            held_tokens += len(chunk) - 1
    model_bits = held_nats / math.log(2)
    # the unigram baseline scores the same predicted tokens (all but the first)
    baseline_bits = unigram_bits(train_ids, held_ids[1:], tokenizer.get_vocab_size())

    samples = {}
    for prompt in ["The ", "def ", "class Cache:\n    def ", "<|user|>\nWhat is assert in Python?"
                   "<|end|>\n<|assistant|>\n"]:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=eos_id)
        samples[prompt] = tokenizer.decode(out[0, ids.shape[1]:].tolist())

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
                   "eos_token": "<|eos|>", "pad_token": "<|pad|>", "unk_token": None,
                   "add_bos_token": False, "model_max_length": 1024,
                   "chat_template": CHAT_TEMPLATE,
                   "additional_special_tokens": SPECIAL_TOKENS[3:]}, handle, indent=2)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": [eos_id,
                  tokenizer.token_to_id("<|end|>")], "pad_token_id": config.pad_token_id,
                  "do_sample": False, "max_new_tokens": 64}
    with open(os.path.join(args.out, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump(generation, handle, indent=2)
    report = {
        "source": source, "parameters": params, "steps": args.steps, "batch": args.batch,
        "seq_len": args.seq_len, "seed": args.seed, "threads": args.threads,
        "train_seconds": round(train_seconds, 1), "torch": torch.__version__,
        "training_tokens": len(train_ids), "held_out_tokens": held_tokens,
        "held_out_bytes": held_bytes,
        "held_out_bits_per_token": model_bits / held_tokens,
        "held_out_bits_per_byte": model_bits / held_bytes,
        "unigram_bits_per_token": baseline_bits / held_tokens,
        "unigram_bits_per_byte": baseline_bits / held_bytes,
        "greedy_samples": samples,
    }
    with open(os.path.join(args.out, "training_report.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
