"""The prompt tokens a step may carry beside decoding rows, from step costs measured as they run:
a mixed step costs at most `factor` decode-only steps by the measured rates; the cap starts at its
initial value, keeps to its bounds, and reads the nearest row count measured."""

from __future__ import annotations

import pytest

from kvcache.engine.step_costs import StepCosts


def test_before_any_measurement_the_cap_is_the_initial_one():
    costs = StepCosts(initial=24)
    assert costs.prefill_cap(4) == 24
    costs.ran(4, 0, 0.010)  # the rows' cost alone: still no token's
    assert costs.prefill_cap(4) == 24


def test_the_cap_keeps_a_mixed_step_within_factor_decode_steps():
    costs = StepCosts(factor=2.0)
    costs.ran(4, 0, 0.010)  # 4 rows alone: 10 ms
    costs.ran(4, 20, 0.020)  # and 20 prompt tokens: 10 ms more, 0.5 ms a token
    assert costs.prefill_cap(4) == 20  # 20 tokens add one more decode step's 10 ms
    assert StepCosts(factor=3.0).prefill_cap(4) == 32  # (unmeasured: the initial cap)
    tripled = StepCosts(factor=3.0)
    tripled.ran(4, 0, 0.010)
    tripled.ran(4, 20, 0.020)
    assert tripled.prefill_cap(4) == 40


def test_a_step_of_prompt_tokens_alone_measures_them_too_and_the_nearest_rows_are_read():
    costs = StepCosts()
    costs.ran(0, 100, 0.050)  # 0.5 ms a token (its weight reads included: the cap is cautious)
    costs.ran(8, 0, 0.030)
    assert costs.prefill_cap(8) == 60
    assert costs.prefill_cap(7) == 60  # 8 rows: the nearest measured
    assert costs.prefill_cap(12) == 64  # and four rows more, each about a prompt token's 0.5 ms


def test_the_cap_is_held_to_the_batch_being_formed_not_the_few_rows_decoding_now():
    costs = StepCosts()
    costs.ran(2, 0, 0.020)  # 2 rows decode: 20 ms
    costs.ran(2, 10, 0.025)  # a token 0.5 ms
    assert costs.prefill_cap(2) == 40
    assert costs.prefill_cap(2, batch=16) == 40 + 14  # 14 rows about to join: 7 ms more a step
    assert costs.prefill_cap(2, batch=1) == 40  # (never below the rows decoding now)


def test_the_cap_keeps_to_its_bounds():
    cheap = StepCosts(minimum=8, maximum=64)
    cheap.ran(1, 0, 0.010)
    cheap.ran(1, 10, 0.010 + 10 * 1e-6)  # a token costs a microsecond: thousands would fit
    assert cheap.prefill_cap(1) == 64
    dear = StepCosts(minimum=8, maximum=64)
    dear.ran(1, 0, 0.001)
    dear.ran(1, 10, 0.101)  # a token costs 10 ms: not even one fits, the minimum still runs
    assert dear.prefill_cap(1) == 8
    with pytest.raises(ValueError, match="factor must be > 1"):
        StepCosts(factor=1.0)


def test_without_a_factor_there_is_no_cap_and_a_restart_measures_afresh():
    unbounded = StepCosts(factor=None)
    unbounded.ran(2, 0, 0.01)
    assert unbounded.prefill_cap(2) is None
    costs = StepCosts(initial=24)
    costs.ran(1, 0, 0.01)
    costs.ran(1, 10, 0.02)
    assert costs.prefill_cap(1) != 24
    costs.restarted()
    assert costs.prefill_cap(1) == 24 and costs.decode_seconds(1) is None
