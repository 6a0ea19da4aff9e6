"""The forward equals transformers' on every architecture, with and without a cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, hf_positions, left_padded_batch

from kvcache import DynamicCache, load_model
from kvcache.model import CacheInTrainingError


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_logits_equal_transformers_on_left_padded_batch(checkpoints, arch, use_cache):
    folder, hf = checkpoints[arch]
    model = load_model(folder, dtype=torch.float32)
    ids, mask = left_padded_batch((10, 7, 4))  # longer than mistral's window of 4
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
        ours = model(ids, attention_mask=mask, use_cache=use_cache).logits
    assert ours.shape == (3, 10, model.config.vocab_size)
    real = mask.bool()  # padding positions carry no meaning
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_step_by_step_with_cache_equals_one_forward(checkpoints, arch):
    model = load_model(checkpoints[arch][0])
    ids, mask = left_padded_batch((9, 6), seed=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits
        steps = [
            model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache).logits,
            *(
                model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache).logits
                for t in range(5, 9)
            ),
        ]
    assert cache.get_seq_length() == 9
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], whole[real], atol=1e-4, rtol=0)


def test_output_carries_the_cache_it_filled(llama_dir):
    model = load_model(llama_dir)
    ids = torch.randint(3, 259, (2, 5))
    with torch.no_grad():
        out = model(ids)
        assert out.past_key_values.get_seq_length() == 5
        again = model(ids[:, :1], past_key_values=out.past_key_values)
        assert again.past_key_values is out.past_key_values
        assert again.past_key_values.get_seq_length() == 6
        assert model(ids, use_cache=False).past_key_values is None
        assert model(ids, logits_to_keep=1).logits.shape == (2, 1, model.config.vocab_size)


def test_positions_follow_the_mask_not_the_padding(llama_dir):
    model = load_model(llama_dir)
    ids, mask = left_padded_batch((8, 5), seed=5)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits[1, -5:]
        alone = model(ids[1:, -5:]).logits[0]
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)


def test_asking_for_a_cache_while_training_is_an_error(llama_dir):
    model = load_model(llama_dir).train()
    ids = torch.randint(3, 259, (1, 4))
    with pytest.raises(CacheInTrainingError, match="inference only"):
        model(ids, use_cache=True)
    with pytest.raises(CacheInTrainingError):
        model(ids, past_key_values=DynamicCache(config=model.config))
    out = model(ids)  # training default: no cache, gradients flow
    assert out.past_key_values is None
    out.logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    with torch.no_grad():  # train mode without gradients may cache
        assert model(ids, use_cache=True).past_key_values.get_seq_length() == 4


def test_mask_of_the_wrong_length_is_an_error(llama_dir):
    model = load_model(llama_dir)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 259, (1, 4)), past_key_values=cache)
        with pytest.raises(ValueError, match=r"\(batch, past \+ new\) = \(1, 5\), got \(1, 1\)"):
            model(torch.tensor([[5]]), attention_mask=torch.ones(1, 1), past_key_values=cache)


def test_bfloat16_model_runs_and_stays_close(checkpoints):
    folder, hf = checkpoints["llama"]
    model = load_model(folder, dtype=torch.bfloat16)
    ids = torch.randint(3, 259, (1, 8))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = hf(ids).logits
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - theirs).abs().max() < 0.25 * theirs.abs().max()
