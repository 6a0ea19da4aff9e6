"""SamplingParams names every field out of range when it is made (a RequestError, never a raw
error from deeper down), and a temperature too small to divide by samples greedily."""

from __future__ import annotations

import pytest

from kvcache.generation.params import GREEDY_BELOW, RequestError, SamplingParams


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"seed": 2**70}, "seed must be below 2\\*\\*64"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": 0}, "top_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ],
)
def test_a_field_out_of_range_is_named(fields, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**fields)


def test_the_largest_seed_a_generator_takes_is_accepted_and_tiny_temperatures_are_greedy():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
