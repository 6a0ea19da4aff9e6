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
