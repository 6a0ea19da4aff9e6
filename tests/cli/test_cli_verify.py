"""`kvcache verify`: each road's streams compared with the cold run's, what differs said (and the
exit status 1 then), its arguments checked."""

from __future__ import annotations

import json

import pytest

from kvcache.cli import main
from kvcache.cli.verify import ROADS, compared, random_prompts


def test_a_difference_is_found_where_a_stream_first_parts_or_ends_early_or_a_logprob_moves():
    def stream(*tokens):
        return [(token, -0.5 * token) for token in tokens]

    cold = [stream(1, 2, 3), stream(4, 5, 6), stream(7, 8, 9), stream(1, 1)]
    moved = stream(1, 1)
    moved[1] = (1, -0.5000001)
    found = compared("chunks of 1", cold, [stream(1, 2, 3), stream(4, 0, 6), stream(7, 8), moved])
    assert [(d.road, d.prompt, d.token, d.logprob_only) for d in found] == [
        ("chunks of 1", 1, 1, False), ("chunks of 1", 2, 2, False), ("chunks of 1", 3, 1, True)]
    assert compared("batch of 8", cold, [list(s) for s in cold]) == []


def test_prompts_are_seeded_and_within_the_vocabulary():
    first = random_prompts(3, 4, 10, 50)
    assert first == random_prompts(3, 4, 10, 50) != random_prompts(4, 4, 10, 50)
    assert len(first) == 4 and all(len(p) == 10 and all(0 <= t < 50 for t in p) for p in first)


@pytest.mark.kernels  # (the bundled model's engine steps run numba's kernels)
def test_every_road_is_reported_and_the_status_says_whether_one_differed(capsys, one_thread):
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


@pytest.mark.kernels
def test_on_a_gguf_with_q8_activations_no_road_changes_a_token_over_200_prompts(tmp_path, capsys, one_thread):
    """The blocks backend with q8 activations is chunk-invariant: 200 random prompts' greedy
    streams are the cold run's on every road, the cache roads finding their prompts' blocks
    (a Q4_K file 256 wide: its products on the matrix unit's tiles where there is one)."""
    from gguf_files import write_gguf
    from tiny_models import hf_model, save_checkpoint

    folder = save_checkpoint(hf_model("llama", hidden_size=256, intermediate_size=512), tmp_path / "wide")
    gguf = write_gguf(folder, tmp_path / "Q4_K.gguf", tensor_type="Q4_K")
    status = main(["verify", "-m", str(gguf), "--prompts", "200", "--prompt-tokens", "18",
                   "--new-tokens", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert {road: found["equal"] for road, found in result["roads"].items()} == {road: 200 for road in ROADS}
    for road in ("prefix cache hit", "disk restore"):  # (a whole block of each prompt at least)
        assert result["roads"][road]["cached_tokens"] >= 200 * 16
    assert status == 0
