"""The stderr progress bar: redrawn in place on a terminal, one line per new label in a log."""

from __future__ import annotations

import io

from kvcache.report.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_new_label():
    log = io.StringIO()
    bar = ProgressBar("kvcache test", stream=log, width=10)
    for fraction, label in [(0.0, "a"), (0.5, "a"), (0.5, "b"), (1.0, "done")]:
        bar(fraction, label)
    lines = log.getvalue().splitlines()
    assert [line.split()[-1] for line in lines] == ["a", "b", "done"]
    assert lines[1].startswith("kvcache test [#####.....]  50%")
    assert lines[2].startswith("kvcache test [##########] 100%")


def test_a_terminal_is_redrawn_in_place_and_ends_with_a_newline():
    screen = _Terminal()
    bar = ProgressBar("kvcache test", stream=screen, width=4)
    bar(0.25, "one")
    bar(2.0, "past the end")  # clamped to 100%
    text = screen.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "[####] 100%" in text


def test_work_done_before_after_s_draws_nothing_and_longer_work_draws(monkeypatch):
    from kvcache.report import progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    quick, slow = io.StringIO(), io.StringIO()
    for stream, took in ((quick, 0.2), (slow, 2.0)):
        bar = ProgressBar("kvcache test", stream=stream, after_s=0.5)
        bar(0.0, "reading")
        clock[0] += took
        bar(1.0, "done")
    assert quick.getvalue() == ""
    assert slow.getvalue().splitlines()[-1].split()[-1] == "done"
