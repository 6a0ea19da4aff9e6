"""Engine's settings come in two checked groups, `PoolConfig` and `SchedulerConfig`: a bad field is
refused when the config is made, by name, and keywords are the same settings by one path."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from kvcache.engine import Engine
from kvcache.engine.config import PoolConfig, SchedulerConfig, configs_from
from kvcache.generation.params import RequestError


@pytest.mark.parametrize(("fields", "named"), [
    (dict(num_blocks=0), "num_blocks"), (dict(num_blocks=2.5), "num_blocks"),
    (dict(num_blocks=True), "num_blocks"), (dict(kv_budget=True), "kv_budget"),
    (dict(kv_budget=None), "kv_budget"), (dict(kv_budget=0), "kv_budget"),
    (dict(kv_budget="lots"), "kv_budget"), (dict(block_size=0), "block_size"),
    (dict(block_size="16"), "block_size"), (dict(prefix_caching="no"), "prefix_caching"),
    (dict(kv_dtype=8), "kv_dtype"), (dict(kv_window=-1), "kv_window"),
])
def test_a_bad_pool_field_is_refused_by_name(fields, named):
    with pytest.raises(RequestError, match=f"^{named}"):
        PoolConfig(**fields)


@pytest.mark.parametrize(("fields", "named"), [
    (dict(max_running=0), "max_running"), (dict(max_running=1.5), "max_running"),
    (dict(max_running=8, token_budget=4), r"token_budget must be an int >= max_running \(8\), got 4"),
    (dict(prefill_slowdown=1.0), "prefill_slowdown"), (dict(prefill_slowdown="2"), "prefill_slowdown"),
])
def test_a_bad_scheduler_field_is_refused_by_name(fields, named):
    with pytest.raises(RequestError, match=f"^{named}"):
        SchedulerConfig(**fields)


def test_a_config_is_frozen_and_a_budget_is_not_read_beside_a_block_count():
    config = PoolConfig(num_blocks=8, kv_budget=None)
    with pytest.raises(AttributeError):
        config.block_size = 4
    assert SchedulerConfig(prefill_slowdown=None).prefill_slowdown is None


def test_keywords_go_to_the_one_config_that_has_them():
    keywords = dict(num_blocks=8, block_size=4, max_running=2, token_budget=8)
    pool, scheduler = configs_from(None, None, keywords)
    assert pool == PoolConfig(num_blocks=8, block_size=4)
    assert scheduler == SchedulerConfig(max_running=2, token_budget=8)
    with pytest.raises(TypeError, match="'max_new_tokens'"):
        configs_from(None, None, dict(max_new_tokens=8))
    with pytest.raises(TypeError, match="block_size beside a PoolConfig"):
        configs_from(PoolConfig(num_blocks=8), None, dict(block_size=4))


def test_an_engine_made_from_configs_equals_one_made_from_keywords():
    model = tiny_model()
    pool, scheduler = PoolConfig(num_blocks=16, block_size=4), SchedulerConfig(max_running=2, token_budget=8)
    grouped = Engine(model, backend="torch", pool=pool, scheduler=scheduler)
    flat = Engine(model, backend="torch", num_blocks=16, block_size=4, max_running=2, token_budget=8)
    assert (grouped.pool_config, grouped.scheduler_config) == (flat.pool_config, flat.scheduler_config)
    assert grouped.limits == flat.limits and grouped.num_blocks == flat.num_blocks == 16
    with pytest.raises(RequestError, match="max_running"):
        Engine(model, backend="torch", num_blocks=16, max_running=0)


def test_the_counters_and_step_costs_learn_from_the_observer_list_and_restart_in_place():
    """The metrics and the step costs are observers: a run counts its steps, tokens, preemptions
    and finish reasons, and `reset_counters` zeroes the same objects the list holds."""
    engine = Engine(tiny_model(), backend="torch", num_blocks=6, block_size=4, max_running=3, token_budget=12)
    assert engine.observers[:2] == [engine.metrics, engine.step_costs]
    done = engine.generate([[1, 2, 3, index] for index in range(3)], max_tokens=8, ignore_eos=True)
    metrics = engine.metrics
    assert [c.finish_reason for c in done] == ["length"] * 3 and metrics.finished == {"length": 3}
    assert metrics.generated_tokens == 24 and metrics.steps > 8 and metrics.preemptions > 0
    assert metrics.decode_tokens > 0 and metrics.prefill_tokens >= 12 and engine.step_costs.decode
    engine.reset_counters()
    assert engine.observers[:2] == [metrics, engine.step_costs] and engine.metrics is metrics
    assert (metrics.steps, metrics.generated_tokens, metrics.finished) == (0, 0, {})
    assert engine.step_costs.decode == {}


def test_the_warm_up_runs_inside_every_observers_warming_and_counts_from_zero_after():
    import contextlib

    from kvcache.engine.observers import StepObserver

    class Watcher(StepObserver):
        def __init__(self):
            self.admitted_while_warming, self.warming_now, self.exited = 0, False, False

        @contextlib.contextmanager
        def warming(self):
            self.warming_now = True
            yield
            self.warming_now, self.exited = False, True

        def admitted(self, requests):
            self.admitted_while_warming += len(requests) if self.warming_now else 0

    engine = Engine(tiny_model(), backend="torch", num_blocks=32, block_size=4, max_running=6,
                    token_budget=48)
    watcher = Watcher()
    engine.observers.append(watcher)
    engine.warm_up()
    assert watcher.exited and watcher.admitted_while_warming == 7  # every warm-up request, inside it
    assert engine.metrics.steps == engine.metrics.generated_tokens == 0 and engine.step_costs.decode == {}


def test_the_warm_up_neither_reads_nor_writes_the_kv_store(tmp_path):
    from kvcache.tiers.disk_store import DiskBlockStore

    engine = Engine(tiny_model(), backend="torch", num_blocks=32, block_size=4, max_running=6,
                    token_budget=48, kv_store=DiskBlockStore(tmp_path / "blocks"))
    try:
        before = engine.stats()["kv_store"]
        engine.warm_up()
        engine.step()  # (a store write is offered after a step: none comes of the warm-up's blocks)
        assert engine.stats()["kv_store"] == before
    finally:
        engine.close()
