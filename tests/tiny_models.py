"""Every tiny model the suite uses, built here and nowhere else (no hub, no network).

- In memory: `tiny_config` / `tiny_model` / `random_model`, kvcache models with every weight
  random (norm weights and biases too).
- On disk: `hf_model` makes a random-weight transformers model of an architecture, and
  `save_checkpoint` writes it as a hub-style folder (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json with a Llama-2 chat template); `llama_checkpoint` does
  both for a plain Llama of any size.
- Inputs: `left_padded_batch`, `hf_positions`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcache.model import LlamaForCausalLM, ModelConfig

VOCAB = 64  # the in-memory tiny models'


def randomize_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every parameter random in place (norm weights 1 + 0.3·N(0, 1), the rest 0.3·N(0, 1)),
    from torch's global generator; returns the model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.3 * torch.randn_like(param) + (1.0 if "norm" in name else 0.0))
    return model


def tiny_config(**overrides) -> ModelConfig:
    """A config.json-style tiny Llama (hidden 32, 4 heads, 2 kv heads, 2 layers, vocab 64) read by
    ModelConfig.from_dict; overrides are config.json fields (model_type, sliding_window, …)."""
    raw = dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return ModelConfig.from_dict({**raw, **overrides})


def step_families(window: int) -> dict[str, dict]:
    """The config overrides the decode steps' tests run on (`tiny_config(**overrides)`): GQA
    groups, a sliding window of `window`, per-head q/k norms, biases with one kv head."""
    return {
        "llama, 2 groups": dict(),
        f"mistral, window {window}": dict(model_type="mistral", sliding_window=window),
        "qwen3 (q/k norms)": dict(model_type="qwen3", head_dim=16),
        "qwen2 (biases), 1 kv head": dict(model_type="qwen2", num_key_value_heads=1),
    }


def random_model(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A kvcache model of `config` with every weight random, in eval mode."""
    torch.manual_seed(seed)
    return randomize_weights(LlamaForCausalLM(config)).eval()


def tiny_model(seed: int = 0, layers: int = 2, vocab: int = VOCAB, **overrides) -> LlamaForCausalLM:
    """`random_model` of `tiny_config(num_hidden_layers=layers, vocab_size=vocab, **overrides)`."""
    return random_model(tiny_config(num_hidden_layers=layers, vocab_size=vocab, **overrides), seed)


HF_VOCAB = 272  # > the test tokenizer's 259 tokens
WINDOW = 4  # mistral's sliding window: shorter than every test sequence

LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

CORPUS = [
    "Hello, what's your name?",
    "My name is LLaMA and I keep keys and values in a cache.",
    "The quick brown fox jumps over the lazy dog.",
    "Attention looks back at every earlier token; the cache keeps them.",
]

_SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=HF_VOCAB,
    initializer_range=0.2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=None,  # tests that want an EOS pass one explicitly
    pad_token_id=None,
)


def hf_model(arch: str, **overrides):
    """A random-weight transformers model of `arch`, norms and biases randomised too."""
    import transformers

    if arch == "llama":
        config = transformers.LlamaConfig(**{**_SMALL, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif arch == "mistral":
        config = transformers.MistralConfig(**{**_SMALL, "sliding_window": WINDOW, **overrides})
        model = transformers.MistralForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{**_SMALL, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "qwen3":  # per-head q/k norms; head_dim given apart from hidden / heads
        settings = {"head_dim": 16, "tie_word_embeddings": True}
        config = transformers.Qwen3Config(**{**_SMALL, **settings, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj; a window on every layer
        config = transformers.Phi3Config(**{**_SMALL, "sliding_window": WINDOW, **overrides})
        model = transformers.Phi3ForCausalLM(config)
    elif arch == "olmo2":  # q/k norms across heads, norms after the sublayers
        config = transformers.Olmo2Config(**{**_SMALL, **overrides})
        model = transformers.Olmo2ForCausalLM(config)
    elif arch == "gemma2":  # sandwich norms (1 + w), GELU, scaled embeddings, soft-capping, windows
        settings = {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 12,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 5.0,
                    "final_logit_softcapping": 3.0}
        config = transformers.Gemma2Config(**{**_SMALL, **settings, **overrides})
        model = transformers.Gemma2ForCausalLM(config)
    elif arch == "gemma":  # (1 + w) norms before the sublayers, GELU, scaled embeddings
        config = transformers.GemmaConfig(**{**_SMALL, "head_dim": 16, **overrides})
        model = transformers.GemmaForCausalLM(config)
    elif arch == "gemma3_text":  # gemma2's layout, q/k norms, local and global RoPE bases
        settings = {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 12,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        config = transformers.Gemma3TextConfig(**{**_SMALL, **settings, **overrides})
        model = transformers.Gemma3ForCausalLM(config)
    elif arch == "qwen2_mixed":  # layer 0 full attention, layer 1 sliding
        settings = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
        config = transformers.Qwen2Config(**{**_SMALL, **settings, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn_like(param))
    return model.eval()


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (byte-level BPE, BOS added) and tokenizer_config.json with a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=259,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": LLAMA2_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def save_checkpoint(model, folder: Path, **save_options) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, **save_options)
    write_tokenizer(folder)
    return folder


def checkpoint_pair(arch: str, folder: Path, seed: int):
    """(a random-weight transformers model of `arch`, kvcache's load of it saved into `folder`)."""
    from kvcache import load_model

    torch.manual_seed(seed)
    model = hf_model(arch)
    save_checkpoint(model, folder)
    return model, load_model(folder)


ARCHS = ("llama", "mistral", "qwen2", "qwen2_mixed", "qwen3", "phi3", "olmo2", "gemma", "gemma2",
         "gemma3_text")


def left_padded_batch(lengths=(10, 7, 4), seed: int = 0):
    """input_ids (B, T) with row b's prompt right-aligned, and the (B, T) attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 259, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0  # pad id; masked out anyway
    return ids, mask


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers.generate derives them from a left-padded mask."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def llama_checkpoint(folder: Path, *, seed: int, **config) -> Path:
    """A random-weight transformers Llama of `config` (LlamaConfig fields; initializer_range 0.1
    unless given) saved with the test tokenizer into `folder`."""
    import transformers

    torch.manual_seed(seed)
    settings = {"initializer_range": 0.1, **config}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    return save_checkpoint(model, folder)


class OwnErrors:
    """Errors of a computation (`ours`) and of a reference one (`theirs`) against the same truth,
    in units of `dtype`'s eps times the truth's largest value; `check` asserts ours within the
    reference's own error: a mean within 1.25× and a worst within 2×."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.ours: list[float] = []
        self.theirs: list[float] = []

    def add(self, ours: torch.Tensor, theirs: torch.Tensor, truth: torch.Tensor) -> None:
        unit = torch.finfo(self.dtype).eps * float(truth.abs().max())
        self.ours.append(float((ours - truth).abs().max()) / unit)
        self.theirs.append(float((theirs - truth).abs().max()) / unit)

    def check(self) -> None:
        assert sum(self.ours) <= 1.25 * sum(self.theirs), (self.ours, self.theirs)
        assert max(self.ours) <= 2 * max(self.theirs), (self.ours, self.theirs)
