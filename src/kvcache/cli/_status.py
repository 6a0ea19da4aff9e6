"""What a command says on stderr while it pauses: a line per kernel compiled on an install's first
run, what the loader said of the weights (the load bar is `kvcache.report.progress.ProgressBar`,
drawn after BAR_AFTER_S)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

#: a phase shorter than this draws no bar
BAR_AFTER_S = 0.5


@contextlib.contextmanager
def compiling_said(command: str, stream=None) -> Iterator[None]:
    """While inside, a line on stderr as each of kvcache's compiled kernels starts compiling (numba
    caches them on disk, so only an install's first run compiles), and one when they are done."""
    from kvcache.backends.cpu import numba_products

    stream = stream or sys.stderr
    started = time.perf_counter()
    compiled: list[str] = []

    def say(kernel: str) -> None:
        compiled.append(kernel)
        stream.write(f"kvcache {command}: compiling kernel {len(compiled)} ({kernel}), once per "
                     f"install; {time.perf_counter() - started:.0f} s so far…\n")
        stream.flush()

    with numba_products.compiling_reported(say):
        yield
    if compiled:
        stream.write(f"kvcache {command}: compiled {len(compiled)} kernels in "
                     f"{time.perf_counter() - started:.0f} s (kept for later runs)\n")
        stream.flush()


def say_weights(program: str, model) -> None:
    """Say on stderr what the loader said of the model's weights (a GGUF's kept blocks and what
    it dequantized: `LlamaForCausalLM.weights_note`), when it said anything."""
    if getattr(model, "weights_note", None):
        print(f"kvcache {program}: weights: {model.weights_note}", file=sys.stderr, flush=True)
