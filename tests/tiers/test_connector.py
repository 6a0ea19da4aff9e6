"""The engine reaches the tiers below its pool through one interface, `KVConnector`: the pool's
`apply` only calls it (`admit`, `load`), and neither a `Request` nor the pool keeps any tier
state (the connector keeps each request's read by its id). Read from the source with `ast`, so a
tier field creeping back onto a request or into `apply` fails here before any run."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvcache.engine.pool
import kvcache.engine.request
from kvcache.tiers.connector import KVConnector
from kvcache.tiers.store_tier import TierConnector

TIER_WORDS = ("store", "read", "tier")  # what a tier field's name would hold


def _method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    owner = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls)
    return next(node for node in owner.body if isinstance(node, ast.FunctionDef) and node.name == name)


def _attributes(node: ast.AST) -> set[str]:
    return {child.attr for child in ast.walk(node) if isinstance(child, ast.Attribute)}


def test_a_request_holds_no_tier_state():
    init = _method(Path(kvcache.engine.request.__file__), "Request", "__init__")
    fields = {target.attr for node in ast.walk(init) if isinstance(node, ast.Assign | ast.AnnAssign)
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Attribute)}
    assert fields  # (the walk found the request's fields)
    assert not [field for field in fields if any(word in field for word in TIER_WORDS)], fields


def test_the_pools_apply_only_calls_the_connector():
    apply = _method(Path(kvcache.engine.pool.__file__), "KVPool", "apply")
    calls = {node.func.attr for node in ast.walk(apply)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "connector"}
    assert calls == {"admit", "load"}
    names = _attributes(apply) - {"connector"}
    assert not [name for name in names if any(word in name for word in TIER_WORDS)], names


def test_the_connector_over_a_store_is_the_interface_and_keeps_nothing_else_public():
    """Every public method of `TierConnector` the pool may call is one `KVConnector` declares
    (the rest: what tests and the server read of it, and the observer hooks)."""
    interface = {name for name, _ in inspect.getmembers(KVConnector, inspect.isfunction)}
    own = {name for name, _ in inspect.getmembers(TierConnector, inspect.isfunction)
           if not name.startswith("_")} - interface
    assert own <= {"reads_on_their_way"}, own
