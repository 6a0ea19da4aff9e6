"""The engine's step holds no feature's own code: what watches a step (the counters, the step
costs, the drift probe, the KV events, the store tier's writes) is an observer on
`Engine.observers`, called at every point of every step, and the step never asks whether one is
on. Read from engine.py's source with `ast`, so a new branch fails here before any run."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache.engine.engine

ENGINE = Path(kvcache.engine.engine.__file__)
# the step and the methods it calls
STEP_METHODS = ("step", "_step", "_preempt", "_run", "_retire")
# what the step may use of the engine: the pool, the runner, the queue, the limits and the step
# costs the scheduler is bounded by, the observer list, the clock and the caller's on_finish; the
# step's own methods
CORE = {"pool", "runner", "waiting", "running", "limits", "step_costs", "observers", "clock",
        "on_finish", "wake", "_step_lock", "_take_incoming", "_step", "_preempt", "_run", "_retire"}
# the step's own state, which it may branch on (nothing to run, no one running)
QUEUE = {"running", "waiting"}


def _step_methods(tree: ast.Module) -> list[ast.FunctionDef]:
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return [m for m in engine.body if isinstance(m, ast.FunctionDef) and m.name in STEP_METHODS]


def _reads_self(node: ast.AST) -> str | None:
    """The `x` of a test that is `self.x`, `self.x.y...`, or compares one of those."""
    if isinstance(node, ast.Compare):
        node = node.left
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    while isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        node = node.value
    return None


def feature_conditionals(source: str) -> list[str]:
    """Each branch of the step methods on a field of the engine other than its queue (`if self.x
    is not None`, `if self.x:`, `... if self.x else ...`), as 'method: self.x'."""
    found = []
    for method in _step_methods(ast.parse(source)):
        for node in ast.walk(method):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                tests = node.test.values if isinstance(node.test, ast.BoolOp) else [node.test]
                names = [name for name in map(_reads_self, tests) if name and name not in QUEUE]
                found += [f"{method.name}: self.{name}" for name in names]
    return found


def features_named(source: str) -> list[str]:
    """Each field of the engine the step methods use outside `CORE`, as 'method: self.x'."""
    found = []
    for method in _step_methods(ast.parse(source)):
        for node in ast.walk(method):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and node.attr not in CORE):
                found.append(f"{method.name}: self.{node.attr}")
    return sorted(set(found))


def test_the_engines_step_branches_on_no_feature():
    source = ENGINE.read_text(encoding="utf-8")
    assert feature_conditionals(source) == []
    loop = "        for observer in self.observers:\n            observer.admitted(admitted)"
    branch = "        if self.drift_probe is not None:\n            self.drift_probe.admitted(admitted)"
    planted = source.replace(loop, branch)
    assert planted != source and feature_conditionals(planted) == ["_step: self.drift_probe"]
    truthy = source.replace(loop, "        if self.kv_events and self.pool:\n            pass")
    assert feature_conditionals(truthy) == ["_step: self.kv_events", "_step: self.pool"]


def test_the_engines_step_names_no_feature_only_its_observers():
    """Counting, measuring and watching happen in observers: the step names none of them."""
    source = ENGINE.read_text(encoding="utf-8")
    assert features_named(source) == []
    planted = source.replace("        return True\n\n    def _preempt",
                             "        self.metrics.steps += 1\n        return True\n\n    def _preempt")
    assert planted != source and features_named(planted) == ["_step: self.metrics"]


def engine_fields_read_by_warm_up(source: str) -> list[str]:
    """What offline.warm_up reads of the engine (`engine.x`), as 'x'."""
    tree = ast.parse(source)
    warm_up = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "warm_up")
    return sorted({node.attr for node in ast.walk(warm_up) if isinstance(node, ast.Attribute)
                   and isinstance(node.value, ast.Name) and node.value.id == "engine"})


def test_the_warm_up_uses_the_engines_public_methods_and_names_no_feature():
    """The warm-up runs inside `Engine.warming` (each observer's own warm-up context): it reaches
    into no pool, store tier or drift probe of the engine."""
    source = (ENGINE.parent / "offline.py").read_text(encoding="utf-8")
    assert engine_fields_read_by_warm_up(source) == ["model", "pool_tokens", "submit", "warming"]
