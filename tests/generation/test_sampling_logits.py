"""The batched sampler's logit changes (logit_bias; presence, frequency and repetition penalties;
min_p beside temperature, top-k and top-p) equal a naive per-row reference on random batches;
greedy rows take the argmax of the adjusted logits; rows that ask for none are not touched."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcache.generation import sampling
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.generation.penalties import SeenTokens
from kvcache.generation.sampling import choose_tokens, processed_logits, top_p_filter

NEAR = 1e-5  # a top-p or min-p decision this close to its boundary may go either way in float32


def reference_row(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> tuple[list[float], bool]:
    """One row processed by hand, in float64: bias, repetition, frequency, presence (vLLM's order);
    then, when it samples, temperature, top-k, top-p, min-p. And whether a top-p or min-p decision
    lay within NEAR of its boundary."""
    row, near = list(logits), False
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in range(len(row)):
        count, penalty = output.count(token), p.repetition_penalty
        if penalty != 1 and (count or token in prompt):
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
        row[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.greedy:
        return row, near
    row = [value / p.temperature for value in row]
    order = sorted(range(len(row)), key=lambda token: -row[token])
    kth = row[order[min(p.top_k, len(row)) - 1]] if p.top_k is not None else -math.inf
    keep = {token for token in order if row[token] >= kth}
    top = max(row)
    near_by = NEAR * (1 + abs(top))  # float32 logits of this size are this coarse
    total = sum(math.exp(value - top) for token, value in enumerate(row) if token in keep)
    before = 0.0
    for token in order:
        if token in keep and p.top_p < 1:
            near |= abs(before - p.top_p) < near_by
            if before >= p.top_p:
                keep.discard(token)
            before += math.exp(row[token] - top) / total
    if p.min_p > 0:
        floor = top + math.log(p.min_p)
        near |= any(abs(row[token] - floor) < near_by for token in keep)
        keep = {token for token in keep if row[token] >= floor}
    return [value if token in keep else -math.inf for token, value in enumerate(row)], near


@st.composite
def rows(draw, vocab: int):
    """(SamplingParams, prompt, output) of one row, every change on or off."""
    maybe = lambda strategy, off: draw(st.one_of(st.just(off), strategy))  # noqa: E731
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)
    params = SamplingParams(
        temperature=maybe(st.floats(0.2, 2.0), 0.0),
        top_k=maybe(st.integers(1, vocab + 2), None),
        top_p=maybe(st.floats(0.05, 1.0), 1.0),
        min_p=maybe(st.floats(0.0, 1.0), 0.0),
        logit_bias=maybe(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=4), {}),
        presence_penalty=maybe(st.floats(-2, 2), 0.0),
        frequency_penalty=maybe(st.floats(-2, 2), 0.0),
        repetition_penalty=maybe(st.floats(0.1, 3.0), 1.0),
    )
    return params, draw(tokens), draw(tokens)


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 40))
    return vocab, draw(st.lists(rows(vocab), min_size=1, max_size=6)), draw(st.integers(0, 2**31))


def seen_of(batch) -> list[SeenTokens | None]:
    return [SeenTokens(prompt + output, len(prompt)) for _, prompt, output in batch]


@settings(max_examples=300, deadline=None)
@given(batches())
def test_processed_logits_equal_a_per_row_reference(case):
    vocab, batch, seed = case
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    ours = processed_logits(logits, [p for p, _, _ in batch], seen_of(batch))
    for row, (p, prompt, output) in enumerate(batch):
        reference, near = reference_row(logits[row].double().tolist(), p, prompt, output)
        assume(not near)
        expected = torch.tensor(reference, dtype=torch.float64)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(expected)), f"row {row}: {p}"
        torch.testing.assert_close(ours[row].double(), expected, rtol=1e-5, atol=1e-4, equal_nan=True)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_greedy_rows_take_the_argmax_and_drawn_rows_only_kept_tokens(case):
    vocab, batch, seed = case
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = [p for p, _, _ in batch]
    tokens = choose_tokens(logits, params, shared=torch.Generator().manual_seed(seed), seen=seen_of(batch))
    kept = processed_logits(logits, params, seen_of(batch))
    for row, p in enumerate(params):
        if p.greedy:
            assert tokens[row] == int(kept[row].argmax())
        else:
            assert math.isfinite(kept[row, tokens[row]])


def test_a_bias_of_minus_100_moves_a_greedy_row_off_its_argmax_and_plus_100_onto_a_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    params = [SamplingParams(), SamplingParams(logit_bias={"1": -100}), SamplingParams(logit_bias={2: 100})]
    assert choose_tokens(logits, params).tolist() == [1, 3, 2]
    assert logits[1, 1] == 5.0  # the caller's logits are left as they were


def test_penalties_count_the_tokens_generated_so_far():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    prompt_then_output = [2, 2]  # a prompt of one token 2, then one generated token 2
    seen = SeenTokens(prompt_then_output, 1)
    penalized = SamplingParams(presence_penalty=1.0)
    assert choose_tokens(logits, [penalized], seen=[seen]).tolist() == [0]
    prompt_then_output.append(0)  # generated: 2, 0 -> token 0 is now penalized
    assert choose_tokens(logits, [penalized], seen=[seen]).tolist() == [1]
    assert seen.output_counts(3).tolist() == [1, 0, 1]
    # the repetition penalty counts the prompt too: token 2 (prompt only) is divided as well
    repeated = processed_logits(torch.tensor([[3.0, 2.0, 1.0]]), [SamplingParams(repetition_penalty=2.0)],
                                [SeenTokens([2, 0], 1)])
    assert repeated.tolist() == [[1.5, 2.0, 0.5]]


def test_a_penalty_without_the_tokens_seen_is_refused():
    with pytest.raises(ValueError, match="SeenTokens"):
        choose_tokens(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)])


def test_rows_that_ask_for_no_change_never_reach_the_changes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("called for rows that asked for nothing")

    monkeypatch.setattr(sampling, "adjust_logits", refuse)
    monkeypatch.setattr(sampling, "min_p_filter", refuse)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    plain, drawn = SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    params = [plain, drawn, plain, plain]
    tokens = choose_tokens(logits, params, shared=torch.Generator().manual_seed(1))
    assert tokens[[0, 2, 3]].tolist() == logits[[0, 2, 3]].argmax(-1).tolist()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_p": 1.5}, r"min_p must be a finite number in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a finite number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"logit_bias": {"12": 101}}, r"logit_bias\['12'\] must be a finite number in \[-100, 100\]"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"1": 1, 1: 2}}, "logit_bias names token 1 twice"),
        ({"logit_bias": [3]}, "logit_bias must map token ids to biases"),
    ],
)
def test_a_sampling_field_out_of_range_is_named(fields, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**fields)


def test_logit_bias_ids_past_the_vocabulary_are_named():
    params = SamplingParams(logit_bias={"9": 1.0, 2: -1})
    assert params.logit_bias == ((2, -1.0), (9, 1.0))
    with pytest.raises(RequestError, match=r"logit_bias token ids must lie in \[0, 8\), got 9"):
        params.check(vocab_size=8)


def _top_p_by_full_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The naive reference: sort the whole vocabulary, keep the prefix whose mass reaches top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.double().softmax(dim=-1)
    drop_sorted = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None].double()) & (top_p[:, None] < 1)
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("vocab", [5, 300, 151_936])
@pytest.mark.parametrize("spread", [0.1, 1.0, 8.0])  # flat (the kept set past the first 256), peaked
def test_top_p_without_a_sort_keeps_what_the_full_sort_keeps(vocab, spread):
    generator = torch.Generator().manual_seed(vocab + int(10 * spread))
    logits = torch.randn(3, vocab, generator=generator, dtype=torch.float64).float() * spread
    top_p = torch.tensor([0.05, 0.9, 1.0])
    ours, theirs = top_p_filter(logits, top_p), _top_p_by_full_sort(logits, top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert int((~ours[1].isinf()).sum()) > (256 if spread == 0.1 and vocab > 300 else 0)
