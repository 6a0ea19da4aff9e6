"""A progress bar on stderr for long work (loading, the report, offline generation). Standard library only."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """Call with (fraction done in [0, 1], a label): redrawn in place on a terminal, one line per
    new label otherwise (logs stay readable). `title` starts every line. Work that ends within
    `after_s` seconds of the bar's creation draws nothing (a quick phase needs no bar)."""

    def __init__(self, title: str, stream=None, width: int = 28, after_s: float = 0.0) -> None:
        self.title, self.stream, self.width = title, stream or sys.stderr, width
        self.live = self.stream.isatty()
        self.started = time.perf_counter()
        self.after_s = after_s
        self.last_label: str | None = None

    def __call__(self, fraction: float, label: str) -> None:
        if self.last_label is None and time.perf_counter() - self.started < self.after_s:
            return  # nothing drawn yet, and the work is still young
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(round(fraction * self.width))
        line = (
            f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {fraction:4.0%} "
            f"{time.perf_counter() - self.started:5.1f}s  {label}"
        )
        if self.live:
            self.stream.write("\r" + line[:110].ljust(110))
            if fraction >= 1.0:
                self.stream.write("\n")
        elif label != self.last_label:
            self.stream.write(line + "\n")
        self.last_label = label
        self.stream.flush()
