"""Rules the source keeps: the model and the cache talk through one seam with no capability
probes, docstrings say what and why (measured figures live in benchmarks/results and docs), files
stay small, functions short, and nothing points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvcache

SOURCE = Path(kvcache.__file__).resolve().parent
FILES = sorted(SOURCE.rglob("*.py"))
# probes for optional capabilities and checks of which methods a subclass overrode
PROBES = re.compile(r"type\((self|model)\)\.\w+ is|getattr\(type\(|getattr\(cache|dict\(locals\(\)\)")
# a measured figure: a number with a unit of time, speed or bandwidth
FIGURE = re.compile(r"\d+(\.\d+)?\s*(µs|ms\b|GB/s|tokens/s|tok/s)")


def test_no_capability_probes_or_override_checks():
    found = [f"{path.relative_to(SOURCE)}:{number}" for path in FILES
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if PROBES.search(line)]
    assert not found, found


def test_docstrings_carry_no_measured_figures():
    found = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node) or ""
                found += [f"{path.relative_to(SOURCE)}: {m.group(0)!r}" for m in FIGURE.finditer(text)]
    assert not found, found


# the package root: the public API, the command's entry and a few stdlib modules; the rest is
# grouped by concept in subpackages
ROOT_MODULES = 6


def test_the_package_root_holds_a_few_modules():
    root = sorted(path.name for path in SOURCE.glob("*.py"))
    assert len(root) <= ROOT_MODULES, root


def test_source_files_stay_small():
    large = {str(path.relative_to(SOURCE)): n for path in FILES
             if (n := len(path.read_text(encoding="utf-8").splitlines())) > 400}
    assert not large, large


# functions allowed past FUNCTION_LINES: declarations read as one list (argparse flags, metrics)
LONG_FUNCTIONS = {("cli/serve.py", "add_parser"), ("server/metrics.py", "__init__")}
FUNCTION_LINES = 60


def _lines_without_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_functions_stay_short():
    """At most FUNCTION_LINES lines a function, its docstring aside (a named few excepted)."""
    long = {}
    for path in FILES:
        name = str(path.relative_to(SOURCE))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = _lines_without_docstring(node)
            if lines > FUNCTION_LINES and (name, node.name) not in LONG_FUNCTIONS:
                long[f"{name}:{node.lineno} {node.name}"] = lines
    assert not long, long


# words of a measurement or a machine, which belong in docs/ and benchmarks/results, not the code
MACHINE_WORDS = re.compile(r"\bmeasured\b|times faster|\b(EPYC|Xeon|Ryzen|AMD|Intel)\b")


def test_backend_modules_say_what_they_are_in_ten_lines_and_leave_measurements_to_the_docs():
    found = {}
    for path in sorted((SOURCE / "backends").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ast.get_docstring(tree) or ""
        if len(module.splitlines()) > 10:
            found[path.name] = f"{len(module.splitlines())} lines"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                words = MACHINE_WORDS.findall(ast.get_docstring(node) or "")
                if words:
                    found[f"{path.name}:{getattr(node, 'name', 'module')}"] = words
    assert not found, found


def test_nothing_points_outside_the_repository():
    root = SOURCE.parents[1]
    texts = [*FILES, root / "README.md", *(root / "docs").glob("*.md")]
    outside = re.compile(r"PERF-NOTES|\.\./shared/")
    found = [str(path) for path in texts if outside.search(path.read_text(encoding="utf-8"))]
    assert not found, found
