"""Where a decode step's time goes, line by line, without a profiler's overhead.

    .venv/bin/python benchmarks/profile_decode_step.py                 # the bundled ~3M model
    .venv/bin/python benchmarks/profile_decode_step.py --model DIR --steps 300 --dtype bfloat16

A profiler's per-call hooks cost more than most lines of the step, so this takes the source of
`ArrayStep._run` (kvcache.backends.cpu.array_step: the numpy step's for float32, the half step's for
bfloat16 or float16, as `choose_backend` picks; `_run_one_row` where that step runs one row on
numba's kernels), puts a `time.perf_counter()` stamp after
every simple statement, runs that copy on the loaded model (each step right after the previous
one, so the weights have just streamed through the CPU caches, as in generation), and prints
each statement's mean time per step, summed over the layers. The cache is reset to the same
length before every step, so every step attends over `--context` keys. Not a test and not the
step that ships: a measuring copy.
Output: stdout only.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import textwrap
import time


def instrumented_run(namespace: dict, stamps: collections.defaultdict, clock: list[float], method: str):
    """A copy of ArrayStep's `method` (`_run`, or `_run_one_row`: one row on numba's kernels)
    with a stamp after every simple statement; returns (function, source lines) where stamps[i]
    accumulates the seconds spent up to source line i."""
    from kvcache.backends.cpu import array_step

    lines = textwrap.dedent(inspect.getsource(getattr(array_step.ArrayStep, method))).splitlines()
    skip = ("#", "if ", "for ", "with ", "def ", '"""', "return", "raise", 'f"', "else", "elif")
    out = []
    body_started = False
    depth = 0  # open brackets: a statement split over lines is stamped after its last line
    first = 0  # the line a statement begins on (its stamp is listed under it)
    for index, line in enumerate(lines):
        out.append(line)
        text = line.strip()
        code = text.split("  #")[0]
        if depth == 0:
            first = index
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if (text.endswith('"""') and index > 0) or (text.startswith("def ") and text.endswith(":")):
            body_started = True  # after the docstring, or after a one-line signature without one
            continue
        indent = len(line) - len(line.lstrip())
        following = lines[index + 1] if index + 1 < len(lines) else ""
        following_indent = len(following) - len(following.lstrip())
        simple = text and not text.startswith(skip) and not text.endswith(("(", ",", ":"))
        if body_started and simple and depth == 0 and following_indent <= indent:
            out.append(" " * (len(lines[first]) - len(lines[first].lstrip())) + f"_stamp({first})")

    def _stamp(index: int) -> None:
        now = time.perf_counter()
        stamps[index] += now - clock[0]
        clock[0] = now

    scope = dict(namespace, _stamp=_stamp)
    exec("\n".join(out), scope)  # our own source, read from the installed module
    return scope[method], lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=128, help="keys each step attends over")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from kvcache import load_model
    from kvcache.backends import choose_backend
    from kvcache.backends.cpu import array_step
    from kvcache.backends.cpu.threads import torch_threads
    from kvcache.cache import make_cache

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    backend = choose_backend(model)
    stamps: collections.defaultdict = collections.defaultdict(float)
    clock = [0.0]
    method = "_run_one_row" if backend._numba_step(1) else "_run"
    run, lines = instrumented_run(vars(array_step), stamps, clock, method)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context))
    token_ids = prompt[0, -1:].numpy()  # (1,)
    # the step's own thread rule (`_threads`: one torch thread beside numba's or numpy's
    # products), which `decode` applies around `_run`
    with torch.inference_mode(), torch_threads(backend._threads(1)):
        cache = make_cache("dynamic", config=model.config, dtype=model.dtype)
        model(prompt, past_key_values=cache, logits_to_keep=1)
        total = 0.0
        for _ in range(args.steps):
            for layer in cache.layers:
                layer.crop(args.context)
            started = clock[0] = time.perf_counter()
            plan = cache.begin(1)
            run(backend, token_ids, plan, cache)
            total += time.perf_counter() - started
    mean = total / args.steps * 1e6
    print(f"one {backend.name} decode step: {mean:.0f} µs (mean of {args.steps}); per statement:")
    for index in sorted(stamps):
        print(f"{stamps[index] / args.steps * 1e6:8.1f} µs  {lines[index].strip()[:96]}")


if __name__ == "__main__":
    main()
