"""kvcache.generate: the same greedy tokens as transformers.generate, across every cache kind
and the no-cache path; chunked prefill, batches, EOS, stop strings, sampling, streaming."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import ARCHS, left_padded_batch

import kvcache
from kvcache import generate, load_model, load_tokenizer, make_cache
from kvcache.cache import CacheConfigError
from kvcache.generation import stream_generate
from kvcache.generation.text import ReplyText

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

NEW = 12


def kinds_for(model) -> list:
    """Every cache kind that keeps this model's answer (a window only where the model has one;
    paged with its windowed layers' own block tables; quantized with its default 128-token
    full-precision residual, which these short sequences never leave), and the no-cache path."""
    kinds = ["dynamic", "static", "quantized", "paged", "none"]
    if set(model.config.layer_types) == {"sliding_attention"}:
        kinds.append("sliding")
    return kinds


@pytest.fixture(scope="module")
def models(checkpoints):
    return {arch: load_model(folder) for arch, (folder, _) in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_generate_for_every_cache_kind(checkpoints, models, arch):
    hf, model = checkpoints[arch][1], models[arch]
    ids, mask = left_padded_batch((10, 7, 4), seed=11)  # 22 tokens: past mistral's window
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for kind in kinds_for(model):
        result = generate(model, ids, mask, max_new_tokens=NEW, cache=kind, eos_token_id=())
        assert torch.equal(result.sequences, theirs), f"cache={kind}"
        assert result.stop_reasons == ["length"] * 3
        assert [len(row) for row in result.new_tokens] == [NEW] * 3


def test_eos_stops_a_row_as_transformers_does(checkpoints, models):
    hf, model = checkpoints["llama"][1], models["llama"]
    ids, mask = left_padded_batch((10, 7, 4), seed=11)
    free = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=())
    eos = free.new_tokens[1][3]  # row 1 stops at its 4th token (maybe others earlier)
    with torch.no_grad():
        theirs = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    ours = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours.sequences, theirs[:, : ours.sequences.shape[1]])
    assert ours.stop_reasons[1] == "eos" and ours.new_tokens[1][-1] == eos
    assert len(ours.new_tokens[1]) <= 4


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2_mixed"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_equals_one_shot(models, arch, chunk):
    model = models[arch]
    ids, mask = left_padded_batch((11, 6), seed=2)
    one_shot = generate(model, ids, mask, max_new_tokens=6, eos_token_id=())
    chunked = generate(model, ids, mask, max_new_tokens=6, eos_token_id=(), prefill_chunk_size=chunk)
    assert torch.equal(chunked.sequences, one_shot.sequences)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_batch_equals_one_by_one(models, arch):
    model = models[arch]
    ids, mask = left_padded_batch((10, 7, 4, 1), seed=7)
    batch = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=())
    for row in range(4):
        prompt = ids[row][mask[row].bool()][None]
        alone = generate(model, prompt, max_new_tokens=NEW, eos_token_id=())
        assert batch.new_tokens[row] == alone.new_tokens[0], f"row {row}"


def test_guide_loop_runs_on_kvcache_and_equals_generate(llama_dir):
    # The Hugging Face caching guide's loop; only the import and loading lines are changed.
    from kvcache import DynamicCache, load_model, load_tokenizer

    device = "cpu"
    model = load_model(llama_dir, dtype=torch.float32).to(device)
    tokenizer = load_tokenizer(llama_dir)

    past_key_values = DynamicCache(config=model.config)
    messages = [{"role": "user", "content": "Hello, what's your name."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(model.device)

    generated_ids = inputs.input_ids
    max_new_tokens = 10

    for _ in range(max_new_tokens):
        outputs = model(**inputs, past_key_values=past_key_values, use_cache=True)
        # Greedily sample one next token
        next_token_ids = outputs.logits[:, -1:].argmax(-1)
        generated_ids = torch.cat([generated_ids, next_token_ids], dim=-1)
        # Prepare inputs for the next generation step by leaving unprocessed tokens, in our case
        # we have only one new token and expanding attention mask for the new token as explained above
        attention_mask = inputs["attention_mask"]
        attention_mask = torch.cat(
            [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1
        )
        inputs = {"input_ids": next_token_ids, "attention_mask": attention_mask}

    text = tokenizer.batch_decode(generated_ids, skip_special_tokens=True)[0]
    # end of the guide's code
    assert text.startswith("[INST] Hello, what's your name. [/INST]")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ours = generate(model, prompt, max_new_tokens=max_new_tokens, eos_token_id=())
    assert torch.equal(generated_ids, ours.sequences)
    assert past_key_values.get_seq_length() == generated_ids.shape[1] - 1


def test_stop_string_ends_the_row(checkpoints, models):
    model, tokenizer = models["llama"], load_tokenizer(checkpoints["llama"][0])
    prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    free = generate(model, prompt, max_new_tokens=NEW, eos_token_id=())

    def reply(tokens) -> str:  # the text a reply reads (ReplyText: the stop rule's reading)
        text = ReplyText(tokenizer)
        return "".join(text.add(token) for token in tokens) + text.finish()

    later = reply(free.new_tokens[0])[len(reply(free.new_tokens[0][:4])) :]  # from the 5th token on
    stop = next(later[i : i + 2] for i in range(len(later) - 1) if "\ufffd" not in later[i : i + 2])
    stopped = generate(
        model, prompt, max_new_tokens=NEW, eos_token_id=(), stop_strings=[stop], tokenizer=tokenizer
    )
    assert stopped.stop_reasons == ["stop_string"]
    assert stop in reply(stopped.new_tokens[0])
    assert stop not in reply(stopped.new_tokens[0][:-1])
    assert stopped.new_tokens[0] == free.new_tokens[0][: len(stopped.new_tokens[0])]


def test_sampling_is_reproducible_from_the_generator(models):
    model = models["qwen2"]
    ids, mask = left_padded_batch((6, 3), seed=4)

    def run(seed, **settings):
        return generate(
            model,
            ids,
            mask,
            max_new_tokens=8,
            eos_token_id=(),
            do_sample=True,
            generator=torch.Generator().manual_seed(seed),
            **settings,
        ).sequences

    assert torch.equal(run(0, temperature=0.7, top_p=0.9), run(0, temperature=0.7, top_p=0.9))
    assert not torch.equal(run(0, temperature=5.0), run(1, temperature=5.0))
    greedy = generate(model, ids, mask, max_new_tokens=8, eos_token_id=()).sequences
    assert torch.equal(run(3, top_k=1), greedy)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_repetition_penalty_gives_the_tokens_transformers_gives(checkpoints, models, arch):
    hf, model = checkpoints[arch][1], models[arch]
    ids, mask = left_padded_batch((9, 9), seed=6)  # no padding: transformers would count pad ids
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             repetition_penalty=1.8, pad_token_id=0)
    ours = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=(), repetition_penalty=1.8)
    assert torch.equal(ours.sequences, theirs)
    plain = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=())
    assert not torch.equal(plain.sequences, theirs)  # the penalty changed the answer


def test_min_p_of_one_samples_the_greedy_tokens(models):
    ids, mask = left_padded_batch((6, 3), seed=4)
    greedy = generate(models["llama"], ids, mask, max_new_tokens=8, eos_token_id=()).sequences
    sampled = generate(models["llama"], ids, mask, max_new_tokens=8, eos_token_id=(), do_sample=True,
                       temperature=3.0, min_p=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled.sequences, greedy)


def test_streaming_yields_each_step_and_returns_the_result(models):
    model = models["llama"]
    ids, mask = left_padded_batch((5, 3), seed=9)
    seen = []
    result = generate(model, ids, mask, max_new_tokens=5, eos_token_id=(), streamer=seen.append)
    assert torch.equal(torch.stack(seen, dim=1), result.sequences[:, ids.shape[1] :])
    steps = stream_generate(model, ids, mask, max_new_tokens=5, eos_token_id=())
    streamed = []
    while True:
        try:
            streamed.append(next(steps))
        except StopIteration as done:
            final = done.value
            break
    assert torch.equal(torch.stack(streamed, dim=1), torch.stack(seen, dim=1))
    assert torch.equal(final.sequences, result.sequences)


def test_timings_are_reported(models):
    result = generate(models["llama"], torch.tensor([[5, 6, 7]]), max_new_tokens=6, eos_token_id=())
    assert result.time_to_first_token_s > 0 and result.decode_time_s > 0
    assert result.decode_steps == 5 and result.decode_tokens_per_s > 0
    assert result.prompt_length == 3


def test_a_given_cache_object_is_used_and_holds_the_context(models):
    model = models["mistral"]
    cache = make_cache("sliding", config=model.config, max_batch_size=1)
    result = generate(model, torch.tensor([[5, 6, 7, 8, 9, 10]]), max_new_tokens=4, cache=cache)
    assert result.cache is cache and cache.get_seq_length() == 9  # the last token is not fed


def test_bad_requests_fail_with_named_errors(models):
    model = models["llama"]
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(TypeError, match="max_tokens"):
        generate(model, ids, max_tokens=5)  # a misspelt setting is refused, not ignored
    with pytest.raises(ValueError, match="pad on the left"):
        generate(model, ids, torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="cache kind must be one of"):
        generate(model, ids, cache="ring")
    with pytest.raises(ValueError, match="no sliding_window in force"):
        generate(model, ids, cache="sliding")
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 272\)"):
        generate(model, torch.tensor([[5, 999]]))
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        generate(model, ids, stop_strings=["x"])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate(model, ids, do_sample=True, temperature=0.0)
    with pytest.raises(CacheConfigError):
        generate(models["qwen2_mixed"], ids, cache="sliding")  # layer 0 attends to everything


def test_a_supplied_cache_that_holds_a_context_continues_it(models):
    """A dense cache filled with a left-padded context, then generate on new tokens with the
    (B, past + T) mask and chunked prefill: each row's tokens are those of one solo run over its
    whole context."""
    model = models["llama"]
    context, mask = left_padded_batch((6, 3), seed=3)
    new = torch.randint(3, 259, (2, 5), generator=torch.Generator().manual_seed(4))
    cache = make_cache("dynamic", config=model.config)
    with torch.inference_mode():
        model(context, attention_mask=mask, past_key_values=cache)
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], dim=1)
    result = generate(
        model, new, full_mask, cache=cache, max_new_tokens=6, eos_token_id=(), prefill_chunk_size=2
    )
    for row in range(2):
        solo = torch.cat([context[row][mask[row].bool()], new[row]])[None]
        alone = generate(model, solo, max_new_tokens=6, eos_token_id=())
        assert result.new_tokens[row] == alone.new_tokens[0], row


def test_chunked_prefill_without_a_cache_runs_the_rest_in_one_forward(models):
    model = models["llama"]
    fed: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[1]))
    try:
        ids = torch.randint(3, 259, (1, 10), generator=torch.Generator().manual_seed(5))
        chunked = generate(model, ids, cache="none", max_new_tokens=1, prefill_chunk_size=2, eos_token_id=())
    finally:
        handle.remove()
    assert fed == [2, 10]  # not 2, 4, 6, 8, 10: a cache that keeps nothing is not refilled per chunk
    whole = generate(model, ids, cache="none", max_new_tokens=1, eos_token_id=())
    assert chunked.new_tokens == whole.new_tokens
    assert chunked.backend == "none" and chunked.decode_steps == 0  # no decode step ran


def test_a_backend_built_before_the_model_changed_is_refused(models):
    from kvcache.backends import BackendError, Float32Backend

    model = copy.deepcopy(models["llama"])
    backend = Float32Backend(model)
    ids = torch.tensor([[5, 6, 7]])
    assert generate(model, ids, max_new_tokens=2, backend=backend).backend == "float32"
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(BackendError, match="build a new one"):
        generate(model, ids, max_new_tokens=2, backend=backend)
    with pytest.raises(BackendError, match="another model"):
        generate(copy.deepcopy(model), ids, max_new_tokens=2, backend=backend)


def test_the_two_roads_give_the_same_tokens_and_a_backend_the_road_would_not_honour_is_refused(models):
    """A paged cache (the default) runs every forward as a step of the backend, as the engine
    does; the other kinds run the model's own forward and take no backend: one they would not
    honour is an error naming both, never ignored."""
    model = models["llama"]
    ids, mask = left_padded_batch([3, 7, 5])
    paged = generate(model, ids, mask, max_new_tokens=6, eos_token_id=())
    dynamic = generate(model, ids, mask, max_new_tokens=6, eos_token_id=(), cache="dynamic")
    assert paged.backend == "float32" and isinstance(paged.cache, kvcache.cache.PagedCache)
    assert dynamic.backend == "torch"
    assert paged.new_tokens == dynamic.new_tokens
    for kind in ("dynamic", "static", make_cache("dynamic", config=model.config)):
        with pytest.raises(ValueError, match=r"backend 'float32' runs a paged cache's steps; cache"):
            generate(model, ids, max_new_tokens=2, cache=kind, backend="float32")
    assert generate(model, ids, max_new_tokens=2, cache="dynamic", backend="torch").backend == "torch"


def test_no_cache_on_a_backend_recomputes_the_whole_sequence_and_keeps_nothing(models):
    """cache="none" on a CPU backend runs every step as the whole sequence again on that backend
    (the cost a cache saves, on the same kernels): the tokens of the cached road, a NoCache left
    empty; on the torch backend it is the model's own forward."""
    model = models["llama"]
    ids, mask = left_padded_batch([3, 7, 5])
    cached = generate(model, ids, mask, max_new_tokens=6, eos_token_id=())
    plain = generate(model, ids, mask, max_new_tokens=6, eos_token_id=(), cache="none")
    reference = generate(model, ids, mask, max_new_tokens=6, eos_token_id=(), cache="none", backend="torch")
    assert (plain.backend, reference.backend) == ("float32", "torch")
    assert plain.new_tokens == cached.new_tokens == reference.new_tokens
    assert isinstance(plain.cache, kvcache.cache.NoCache) and plain.cache.get_seq_length() == 0
