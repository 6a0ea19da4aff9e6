"""The live drift probe of a quantized pool: a probed request's exact distributions are the
full-precision model's over the same history (its greedy agreement is what a float forward of
the request's tokens says), one position per generated token through prefix sharing and chunked
prefill; the probe changes no answer; int4 drifts more than int8; a sample of 0.5 probes about
half the requests; the counts reach `stats()` and each Completion."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.engine import Engine, RequestError

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model(one_thread):
    return kvcache.load_model()


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 1024, (8,), generator=generator).tolist()
    return [shared + torch.randint(0, 1024, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 40, (count,), generator=generator)]


def _engine(model, kv_dtype, sample):
    return Engine(model, num_blocks=2048, block_size=4, max_running=4, token_budget=16, kv_dtype=kv_dtype,
                  kv_drift_sample=sample)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_exact_side_is_the_float_model_over_the_same_history(model, kv_dtype):
    prompts = _prompts(5, seed=1)
    probed = _engine(model, kv_dtype, 1.0).generate(prompts, max_tokens=12, ignore_eos=True)
    plain = _engine(model, kv_dtype, 0.0).generate(prompts, max_tokens=12, ignore_eos=True)
    assert [c.tokens for c in probed] == [c.tokens for c in plain]  # the probe changes nothing
    assert all(c.kv_drift is None for c in plain)
    for completion in probed:
        drift = completion.kv_drift
        assert drift.positions == len(completion.tokens) == 12
        every = torch.tensor([completion.prompt + completion.tokens[:-1]])
        with torch.inference_mode():
            logits = model(every).logits[0, len(completion.prompt) - 1 :]  # (12, vocab): exact, no cache
        agree = (logits.argmax(-1) == torch.tensor(completion.tokens)).sum().item()
        assert drift.agreements == agree
        assert all(value >= 0 for value in drift.kl) and max(drift.kl) > 0


def test_int4_drifts_more_than_int8_and_the_counts_reach_stats(model):
    prompts = _prompts(6, seed=2)
    found = {}
    for kv_dtype in ("int8", "fp8/bfloat16", "int4"):
        engine = _engine(model, kv_dtype, 1.0)
        completions = engine.generate(prompts, max_tokens=10, ignore_eos=True)
        found[kv_dtype] = sum(sum(c.kv_drift.kl) for c in completions)
        stats = engine.stats()["kv_drift"]
        assert stats["positions"] == 60 and stats["probing"] == 0
        assert stats["top1_agreement"] == sum(c.kv_drift.agreements for c in completions) / 60
    assert found["int4"] > 4 * found["int8"] > 0
    assert found["int4"] > found["fp8/bfloat16"] > 0


def test_a_sample_probes_a_share_of_requests_and_needs_a_quantized_pool(model):
    engine = Engine(model, num_blocks=2048, block_size=4, max_running=4, token_budget=16, kv_dtype="int8",
                    kv_drift_sample=0.5)
    completions = engine.generate(_prompts(40, seed=3), max_tokens=2, ignore_eos=True)
    probed = sum(c.kv_drift is not None for c in completions)
    assert 8 <= probed <= 32  # (binomial 40, 0.5: outside this, p < 1e-4)
    with pytest.raises(RequestError, match="kv_dtype"):
        Engine(model, num_blocks=64, kv_drift_sample=0.1)
    with pytest.raises(ValueError, match=r"kv_drift_sample must be in \(0, 1\]"):
        Engine(model, num_blocks=64, kv_dtype="int8", kv_drift_sample=1.5)


def test_warming_up_runs_the_shadow_then_counts_from_zero(model):
    engine = _engine(model, "int8", 0.01)
    engine.warm_up()  # (every warm-up request probed, whatever the sample)
    assert engine.drift_probe.sample == 0.01
    expected = {"sample": 0.01, "probing": 0, "positions": 0, "top1_agreement": None, "seconds": 0.0}
    assert engine.stats()["kv_drift"] == expected
