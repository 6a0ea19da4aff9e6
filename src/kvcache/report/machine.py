"""The machine and versions a report's figures came from (standard library; torch's details only
when it is already imported, numpy's and matplotlib's versions from their installed metadata)."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from importlib import metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_figures() -> dict:
    """Platform, CPU, CPU counts, load average, Python and library versions, UTC time."""
    import kvcache

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    figures = {
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_1_5_15": _load(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "kvcache": kvcache.__version__,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        figures["torch"] = torch.__version__
        figures["torch_threads"] = torch.get_num_threads()
        figures["torch_mkl"] = bool(torch.backends.mkl.is_available())
        figures["cuda_available"] = bool(torch.cuda.is_available())
    for name in ("numpy", "matplotlib"):
        try:
            figures[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            figures[name] = None
    return figures


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages now (None where the platform has none)."""
    return _load()
