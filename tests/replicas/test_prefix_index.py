"""The router's prefix index: a conversation's next turn goes back to the replica that served it,
a shared prefix to the replica holding most of it, load breaks ties and overrides a match only
past the imbalance allowed."""

from __future__ import annotations

import pytest

from kvcache.blocks import prefix_digests
from kvcache.replicas.prefix_index import PrefixIndex

BLOCK = 4


def digests(tokens: list[int]) -> list[bytes]:
    return prefix_digests(tokens, BLOCK)


def test_the_next_turn_returns_to_the_replica_that_served_the_first():
    index = PrefixIndex()
    first = list(range(10))
    index.record("a", digests(first))
    index.record("b", digests(list(range(100, 110))))
    second = first + [50, 51, 52, 53, 54]  # the first turn, its answer, the next question
    assert index.rank(["a", "b"], digests(second), {"a": 3, "b": 0}, imbalance=8)[0] == ["a"]


def test_the_longest_leading_match_wins_and_a_middle_match_counts_for_nothing():
    index = PrefixIndex()
    prompt = list(range(20))
    index.record("a", digests(prompt[:8]))
    index.record("b", digests(prompt[:16]))
    index.record("c", digests(prompt)[1:])  # every block but the first: no leading run
    assert index.matched("c", digests(prompt)) == 0
    assert index.rank(["a", "b", "c"], digests(prompt), {}, imbalance=8) == [["b"], ["a"], ["c"]]


@pytest.mark.parametrize("load_of_a, expected", [(5, "a"), (9, "b")])
def test_load_overrides_a_match_only_past_the_imbalance(load_of_a, expected):
    index = PrefixIndex()
    prompt = list(range(12))
    index.record("a", digests(prompt))
    assert index.rank(["a", "b"], digests(prompt), {"a": load_of_a, "b": 1}, imbalance=7)[0] == [expected]


def test_without_a_match_the_least_loaded_goes_first_and_a_forgotten_replica_matches_nothing():
    index = PrefixIndex(capacity=2)
    prompt = list(range(16))
    index.record("a", digests(prompt))  # three blocks: only the last two are kept
    assert index.matched("a", digests(prompt)) == 0
    assert index.rank(["a", "b", "c"], digests(prompt), {"a": 2, "b": 0, "c": 1}, 8) == [["b"], ["c"], ["a"]]
    index.record("b", digests(prompt)[:2])
    index.forget("b")
    assert index.matched("b", digests(prompt)) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


@pytest.mark.parametrize("load_of_a, expected", [(2, "a"), (3, "b")])
def test_a_shared_prefix_holds_a_new_prompt_only_while_the_loads_are_near(load_of_a, expected):
    index = PrefixIndex()
    system = list(range(8))  # two blocks every conversation starts with
    index.record("a", digests(system + [20, 21, 22, 23, 24]))  # (a prompt's last token is not hashed)
    index.record("a", digests(system + [30, 31, 32, 33, 34]))
    new = digests(system + [40, 41, 42, 43, 44])
    assert index.matched("a", new) == 2
    assert index.rank(["a", "b"], new, {"a": load_of_a, "b": 0}, imbalance=8)[0] == [expected]
    # the next turn of a conversation on "a" stays there at the same load: its match is its own
    next_turn = digests(system + [20, 21, 22, 23, 24, 25, 26, 27, 28])
    assert index.rank(["a", "b"], next_turn, {"a": 3, "b": 0}, imbalance=8)[0] == ["a"]
