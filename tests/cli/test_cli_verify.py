"""`kvcache verify`: each road's streams compared with the cold run's, what differs said (and the
exit status 1 then), its arguments checked."""

from __future__ import annotations

import json

import pytest

from kvcache.cli import main
from kvcache.cli.verify import ROADS, compared, random_prompts


def test_a_difference_is_found_where_a_stream_first_parts_or_ends_early():
    cold = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    found = compared("chunks of 1", cold, [[1, 2, 3], [4, 0, 6], [7, 8]])
    assert [(d.road, d.prompt, d.token) for d in found] == [("chunks of 1", 1, 1), ("chunks of 1", 2, 2)]
    assert compared("batch of 8", cold, [list(s) for s in cold]) == []


def test_prompts_are_seeded_and_within_the_vocabulary():
    first = random_prompts(3, 4, 10, 50)
    assert first == random_prompts(3, 4, 10, 50) != random_prompts(4, 4, 10, 50)
    assert len(first) == 4 and all(len(p) == 10 and all(0 <= t < 50 for t in p) for p in first)


@pytest.mark.kernels  # (the bundled model's engine steps run numba's kernels)
def test_every_road_is_reported_and_the_status_says_whether_one_differed(capsys):
    status = main(["verify", "--prompts", "2", "--prompt-tokens", "24", "--new-tokens", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["roads"]) == set(ROADS) and result["prompts"] == 2
    differing = sum(len(road["differing"]) for road in result["roads"].values())
    assert all(road["equal"] + len(road["differing"]) == 2 for road in result["roads"].values())
    assert status == (1 if differing else 0)


def test_a_prompt_past_the_models_context_is_refused_naming_the_flags(capsys):
    assert main(["verify", "--prompt-tokens", "100000", "--new-tokens", "4"]) == 1
    error = capsys.readouterr().err
    assert "--prompt-tokens 100000" in error and "--new-tokens 4" in error and "context" in error
