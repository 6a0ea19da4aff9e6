"""The package's import graph: kvcache, kvcache.reference and kvcache.memory import no torch; no
two modules import each other (directly or round a loop); data flows one way (cli -> generation
-> backends -> model -> cache), so a lower layer never imports a higher one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvcache

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

SOURCE = Path(kvcache.__file__).resolve().parent


def test_import_kvcache_does_not_import_torch():
    code = (
        "import sys, kvcache, kvcache.reference, kvcache.memory, kvcache.geometry, kvcache.cli;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'numpy' not in sys.modules, 'numpy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_single_process_server_does_not_import_ray():
    code = (
        "import sys, kvcache.cli.serve, kvcache.server.app, kvcache.engine;"
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kvcache_and_its_caches_work_without_importing_transformers():
    """transformers is imported by kvcache.hf only, on demand."""
    code = (
        "import sys, kvcache, kvcache.cache, kvcache.model, kvcache.generation;"
        "assert 'transformers' not in sys.modules, 'transformers imported';"
        "assert 'kvcache.hf' not in sys.modules, 'kvcache.hf imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loading_a_folders_tokenizer_does_not_import_torch():
    """Telling a GGUF file from a folder is a stdlib check (kvcache.defaults.is_gguf): a tokenizer
    alone costs no torch import."""
    code = (
        "import sys, kvcache;"
        "kvcache.load_tokenizer();"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """kvcache modules that `path` imports when it runs (module level and inside functions;
    `if TYPE_CHECKING:` blocks are not run and not counted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in SOURCE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between modules, a package's __init__ (which re-exports its modules) left out."""
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    return {name: edges - packages for name, edges in graph.items() if name not in packages}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_pair_or_loop_imports_each_other():
    graph = _without_packages(_graph())
    assert len(graph) > 40  # the walk found the package
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_planted_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# each layer of the package and what it must never import (the layers above it)
FORBIDDEN = {
    "kvcache.cache": ("kvcache.model", "kvcache.backends", "kvcache.generation", "kvcache.cli",
                      "kvcache.hf"),
    "kvcache.model": ("kvcache.backends", "kvcache.generation", "kvcache.cli", "kvcache.reuse.prefix",
                      "kvcache.hf"),
    "kvcache.backends": ("kvcache.generation", "kvcache.cli", "kvcache.reuse.prefix", "kvcache.hf"),
    "kvcache.generation": ("kvcache.cli", "kvcache.reuse.prefix", "kvcache.hf"),
    "kvcache.hf": ("kvcache.model", "kvcache.backends", "kvcache.generation", "kvcache.cli"),
    "kvcache.blocks": ("kvcache.cache", "kvcache.model", "kvcache.backends", "kvcache.engine",
                       "kvcache.generation", "kvcache.cli", "kvcache.hf"),
    "kvcache.geometry": ("kvcache.cache", "kvcache.model", "kvcache.memory"),
    "kvcache.memory": ("kvcache.cache", "kvcache.model"),
    "kvcache.reference": ("kvcache.cache", "kvcache.model", "kvcache.backends"),
}


@pytest.mark.parametrize("package", ["kvcache.blocks", "kvcache.cache", "kvcache.model", "kvcache.engine",
                                     "kvcache.reuse", "kvcache.server", "kvcache.tiers.store_tier"])
def test_each_package_imports_first_in_a_fresh_interpreter(package):
    """A loop through a package's __init__ (which the module graph above leaves out) shows only
    when that package is the first one imported."""
    subprocess.run([sys.executable, "-c", f"import {package}"], check=True)


def test_the_block_bookkeeping_uses_no_torch():
    found = [f"{path.name}: {ast.unparse(node)}" for path in sorted((SOURCE / "blocks").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, (ast.Import, ast.ImportFrom))
             and any("torch" in name for name in [getattr(node, "module", None) or ""]
                     + [alias.name for alias in node.names])]
    assert not found, found


def test_data_flows_one_way():
    graph = _graph()
    wrong = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        for layer, above in FORBIDDEN.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if any(target == up or target.startswith(up + ".") for up in above)
    ]
    assert not wrong, wrong


@pytest.mark.parametrize(
    "code, preset, expected",
    [
        ("import kvcache, numpy", None, "20"),  # kvcache first: OpenBLAS reads the shorter spin
        ("import kvcache, numpy", "25", "25"),  # a value the user set is kept
        ("import numpy, kvcache", None, None),  # too late for OpenBLAS: nothing is changed
    ],
)
def test_importing_kvcache_before_numpy_shortens_openblas_spinning(code, preset, expected):
    import os

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    shown = subprocess.run(
        [sys.executable, "-c", f"{code}; import os; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert shown == str(expected)
