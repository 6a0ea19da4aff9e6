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


class BytesProgress:
    """Call with (bytes done, bytes in all, what is happening): a `ProgressBar` line of the bytes
    done and the phase, redrawn at most every `every_s` seconds on a terminal, and once a phase
    otherwise (a log gets a line per part, not one per chunk)."""

    def __init__(self, title: str, stream=None, every_s: float = 0.25) -> None:
        from kvcache.report.progress import ProgressBar

        self.bar = ProgressBar(title, stream)
        self.every_s = every_s
        self.drawn_at = float("-inf")
        self.phase: str | None = None

    def __call__(self, done: int, total: int, phase: str) -> None:
        now = time.perf_counter()
        due = self.bar.live and now - self.drawn_at >= self.every_s
        if phase == self.phase and not due:
            return
        self.drawn_at, self.phase = now, phase
        self.bar(done / total if total else 1.0, f"{done / 1e6:.1f}/{total / 1e6:.1f} MB  {phase}")


def choose_threads(command: str, threads: int | None, watch) -> None:
    """Run torch's CPU threads (the kernels' follow them) on `threads` where given (--threads),
    else on torch's count lowered by the cores other processes kept busy since `watch` (a
    `threads.CoreWatch`) started, said on stderr when it is lowered."""
    import torch

    from kvcache.backends.cpu.threads import threads_beside_other_work

    if threads:
        torch.set_num_threads(threads)
        return
    threads, busy = torch.get_num_threads(), watch.busy_elsewhere()
    chosen = threads_beside_other_work(threads, busy)
    if chosen < threads:
        torch.set_num_threads(chosen)
        print(f"kvcache {command}: other processes kept {busy:.1f} cores busy while the "
              f"model loaded: running on {chosen} thread{'s' if chosen > 1 else ''}, not {threads} "
              "(--threads to choose)", file=sys.stderr, flush=True)
