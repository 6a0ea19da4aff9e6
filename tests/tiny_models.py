"""A tiny random-weight Llama built in memory (no checkpoint), for tests of caches behind the
model seam (paged, prefix reuse, prompt cache)."""

from __future__ import annotations

import torch

from kvcache.model import LlamaForCausalLM, ModelConfig

VOCAB = 64


def tiny_model(seed: int = 0, layers: int = 2, vocab: int = VOCAB) -> LlamaForCausalLM:
    """A random fp32 Llama (hidden 32, 4 heads, 2 kv heads), every weight randomised."""
    config = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    ))
    torch.manual_seed(seed)
    return randomize_weights(LlamaForCausalLM(config).eval())


def randomize_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every parameter random in place (norm weights 1 + 0.3·N(0, 1), the rest 0.3·N(0, 1)),
    from torch's global generator; returns the model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.3 * torch.randn_like(param) + (1.0 if "norm" in name else 0.0))
    return model
