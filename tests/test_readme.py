"""Every code block in README.md runs as written: the Python blocks run, each shell command exits
0, and an output block shown right after a command is what that command prints (timings aside).
The demo's output block is what `make demo` prints. `make test` is the one command not run here:
it is this suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
# figures that move between runs: timings, speeds, ratios
TIMING = re.compile(r"\d+(\.\d+)?(?= ms| tokens/s|x\b)")
# lines that come and go with the machine: a progress bar (drawn when loading takes long enough),
# the kernels compiled on an install's first run, the threads lowered beside other busy processes
TRANSIENT = re.compile(r"\[[#.]+\] +\d+%|: compil(ing|ed) \d* ?kernel|: other processes kept [\d.]+ cores")


def blocks() -> list[tuple[str, str]]:
    return [(language, code) for language, code in BLOCK.findall(README.read_text(encoding="utf-8"))]


def _commands(code: str) -> list[str]:
    lines = (line.split("#")[0].strip() for line in code.splitlines())
    return [line for line in lines if line]


def _run(command: str) -> str:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    # what a terminal shows: the text on stdout, the statistics on stderr, in the order written
    done = subprocess.run(command, shell=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}"
    return done.stdout


def _same_output(printed: str, shown: str) -> None:
    def clean(text: str) -> list[str]:
        lines = text.strip("\n").splitlines()
        return [TIMING.sub("N", line.rstrip()) for line in lines if not TRANSIENT.search(line)]

    assert clean(printed) == clean(shown)


def test_the_readme_opens_with_the_two_commands():
    language, code = blocks()[0]
    assert language == "sh" and _commands(code) == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_python_blocks_run():
    python = [code for language, code in blocks() if language == "python"]
    assert python
    for code in python:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, f"block failed:\n{code}\n{done.stderr[-2000:]}"


def test_shell_blocks_run_and_print_what_is_shown():
    found = blocks()
    ran = 0
    for index, (language, code) in enumerate(found):
        if language != "sh" or index == 0:  # the set-up block: see test_the_demo_prints_what_is_shown
            continue
        commands = _commands(code)
        outputs = [_run(command) for command in commands]
        ran += len(commands)
        following = found[index + 1] if index + 1 < len(found) else ("", "")
        if following[0] == "text" and len(commands) == 1:
            _same_output(outputs[0], following[1])
    assert ran >= 2


def test_the_demo_prints_what_is_shown():
    shown = next(code for language, code in blocks() if language == "text")
    _same_output(_run("make -s demo"), shown)


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert links and not missing, missing
