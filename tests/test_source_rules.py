"""Rules the source keeps: the model and the cache talk through one seam with no capability
probes, docstrings say what and why (measured figures live in benchmarks/results and docs),
functions stay short (files are as long as their one purpose needs), no module reads another's
private members or attaches methods to another's class, and nothing points outside the
repository."""

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


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions, classes and methods, names assigned in its
    class bodies, and attributes it assigns on any object (`self._x = …`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for part in ast.walk(target) if target is not None else ():
                if isinstance(part, ast.Attribute):
                    names.add(part.attr)
                elif isinstance(part, ast.Name):
                    names.add(part.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _private_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """`thing._name` reads where thing is not self, cls or super()."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append((node.lineno, node.attr))
    return found


def private_reads_across_modules(sources: dict[str, str]) -> list[str]:
    """Where a module reads a private member (`x._name`, x not self) that another module of
    `sources` (name -> text) defines and it does not: a private of a third-party library is no
    concern of this rule."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = {name: _private_names_defined(tree) for name, tree in trees.items()}
    everywhere = set().union(*defined.values())
    return [
        f"{name}:{line} ._{attr.lstrip('_')}"
        for name, tree in trees.items()
        for line, attr in _private_reads(tree)
        if attr in everywhere and attr not in defined[name]
    ]


def methods_attached_from_elsewhere(text: str) -> list[str]:
    """Class attributes bound to a function imported from another module (`method = imported`
    in a class body) and assignments onto a class from outside it (`Class.name = …`, setattr)."""
    tree = ast.parse(text)
    imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    classes = imported | {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                value = getattr(statement, "value", None)
                if isinstance(statement, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Name) \
                        and value.id in imported and not value.id.isupper():  # (a constant is no method)
                    found.append(f"{node.name}.{ast.unparse(statement).split('=')[0].strip()}")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id in classes:
                found.append(ast.unparse(target))
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "setattr" \
                and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in classes:
            found.append(ast.unparse(call))
    return found


def _sources() -> dict[str, str]:
    return {str(path.relative_to(SOURCE)): path.read_text(encoding="utf-8") for path in FILES}


def test_no_module_reads_another_modules_private_members():
    found = private_reads_across_modules(_sources())
    assert not found, found


def test_the_private_read_finder_finds_a_planted_read():
    sources = {
        "a.py": "class A:\n    def _hidden(self):\n        self._state = 1\n",
        "b.py": "def use(a):\n    a._hidden()\n    return a._state, a._version\n",
        "c.py": "class C:\n    def _hidden(self):\n        return other._hidden()\n",
    }
    # b reads two of a's privates (torch's _version is none of the package's); c defines its own
    assert private_reads_across_modules(sources) == ["b.py:2 ._hidden", "b.py:3 ._state"]


def test_no_method_is_attached_to_a_class_from_another_module():
    found = {name: attached for name, text in _sources().items()
             if (attached := methods_attached_from_elsewhere(text))}
    assert not found, found


def test_the_attachment_finder_finds_planted_ones():
    text = (
        "from .rows import LIMIT, read_row\nfrom .cache import Cache\n"
        "class Paged:\n    row_state = read_row\n    limit = LIMIT\n"
        "Cache.extra = read_row\nsetattr(Cache, 'more', read_row)\n"
    )
    assert methods_attached_from_elsewhere(text) == [
        "Paged.row_state", "Cache.extra", "setattr(Cache, 'more', read_row)"
    ]


# functions allowed past FUNCTION_LINES: declarations read as one list (argparse flags, metrics)
LONG_FUNCTIONS = {("cli/serve.py", "add_parser"), ("cli/generate.py", "add_parser"),
                  ("server/metrics.py", "__init__")}
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
    for path in sorted((SOURCE / "backends").rglob("*.py")):
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
