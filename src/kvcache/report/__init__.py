"""`kvcache report`: the lab's counted figures and the engine's measured ones in one document.

    from kvcache.report import write_report
    report = write_report("report/", quick=True)      # report.md, report.json, five PNGs

Importing this package imports neither torch nor matplotlib: `collect` (figures), `plots` (PNGs,
matplotlib's Agg canvas) and `render` (Markdown) are loaded when `write_report` runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from kvcache.report.settings import ReportSettings

__all__ = ["ReportSettings", "write_report"]

# The PNGs a report writes, by section.
PLOTS = ("counts", "latency", "equality", "drift", "memory")


def write_report(out_dir: str | Path, model_dir: str | Path | None = None, quick: bool = False,
                 progress: Callable[[float, str], None] | None = None, **changes) -> dict:
    """Collect every figure, draw the plots, write report.md and report.json into `out_dir`.

    model_dir: checkpoint folder (None: the bundled default model); quick: the small run;
    changes: `ReportSettings` fields to override. Returns the report dict (as in report.json,
    with "plots": {section: file name}). progress(fraction, label) as in `collect_report`.
    """
    from kvcache.report.collect import collect_report
    from kvcache.report.plots import draw_plots
    from kvcache.report.render import report_markdown

    say = progress or (lambda fraction, label: None)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    settings = ReportSettings.for_run(quick, **changes)
    started = time.perf_counter()
    report = collect_report(settings, model_dir, lambda fraction, label: say(0.9 * fraction, label))
    say(0.9, "plots")
    report["plots"] = draw_plots(report, folder)
    report["elapsed_s"] = time.perf_counter() - started
    say(0.99, "report.md")
    (folder / "report.md").write_text(report_markdown(report, report["plots"]), encoding="utf-8")
    with open(folder / "report.json", "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, allow_nan=False)
        handle.write("\n")
    say(1.0, "done")
    return report
