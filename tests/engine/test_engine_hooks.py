"""A caller's `on_finish` hook cannot orphan requests: one that raises is reported and every other
request finishing in the same step still completes; one that raises SystemExit ends the loop
said on stderr, and no request is left waiting."""

from __future__ import annotations

import pytest

import kvcache
from kvcache.engine import Engine

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model(one_thread):
    return kvcache.load_model()


def test_a_raising_hook_is_reported_and_every_request_of_that_step_completes(model, capsys):
    engine = Engine(model, kv_budget="4MiB")
    seen = []

    def hook(completion):
        seen.append(completion.request_id)
        if len(seen) == 1:
            raise RuntimeError("metrics backend down")

    engine.on_finish = hook
    handles = [engine.submit([5, 6, 7, index], max_tokens=3, ignore_eos=True) for index in range(3)]
    results = [handle.result() for handle in handles]  # the same length: they finish in one step
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert sorted(seen) == [h.request_id for h in handles]
    assert "on_finish raised RuntimeError: metrics backend down" in capsys.readouterr().err
    assert engine.submit([9, 9], max_tokens=2, ignore_eos=True).result().finish_reason == "length"


def test_a_hook_raising_system_exit_stops_the_loop_loudly_and_leaves_no_one_waiting(model, capsys):
    engine = Engine(model, kv_budget="4MiB")

    def hook(completion):
        raise SystemExit(3)

    engine.on_finish = hook
    quick = engine.submit([5, 6], max_tokens=1, ignore_eos=True)
    slow = engine.submit([7, 8], max_tokens=50, ignore_eos=True)
    engine.start()
    assert quick.result(timeout=120).finish_reason == "length"
    completion = slow.result(timeout=120)  # the loop ended: this one failed, not forgotten
    assert completion.finish_reason == "error" and "SystemExit" in completion.error
    assert not engine.running_in_background
    assert "the loop stops on SystemExit" in capsys.readouterr().err


def test_an_observer_sees_every_point_of_each_step_in_order(model):
    """`Engine.observers`: admitted, forwarded, released, stepped, step_ended at the points the
    observers module names, for every request; closed with the engine."""
    from kvcache.engine.observers import StepObserver

    class Recorder(StepObserver):
        def __init__(self):
            self.calls = []

        def admitted(self, requests):
            self.calls += [("admitted", r.id) for r in requests]

        def forwarded(self, work, logits):
            assert logits.shape[0] == len(work.batch.sampled)
            self.calls.append(("forwarded", tuple(r.id for r in work.requests)))

        def released(self, requests):
            self.calls += [("released", r.id) for r in requests]

        def stepped(self, cache):
            self.calls.append(("stepped",))

        def step_ended(self):
            self.calls.append(("step_ended",))

        def close(self):
            self.calls.append(("close",))

    engine = Engine(model, kv_budget="4MiB")
    recorder = Recorder()
    engine.observers.append(recorder)
    handles = [engine.submit([5, 6, 7, index], max_tokens=2, ignore_eos=True) for index in range(2)]
    ids = [handle.request_id for handle in handles]
    assert all(handle.result().finish_reason == "length" for handle in handles)
    engine.close()
    calls = recorder.calls
    assert calls[:2] == [("admitted", ids[0]), ("admitted", ids[1])]
    assert calls[2] == ("forwarded", tuple(ids)) and calls[3:5] == [("stepped",), ("step_ended",)]
    assert calls.count(("step_ended",)) == calls.count(("stepped",)) == 2  # two steps of two tokens
    assert sorted(c for c in calls if c[0] == "released") == [("released", i) for i in ids]
    assert calls.index(("released", ids[0])) > calls.index(("stepped",), 4) and calls[-1] == ("close",)
