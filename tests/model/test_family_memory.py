"""The memory planner reads every family's config.json as the model does: the bytes it predicts
for a sequence equal what the model's own cache holds after that sequence (head_dim apart from
hidden / heads in qwen3 and gemma2, windows on some layers or all)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS

from kvcache import load_model
from kvcache.memory import KVShape


@pytest.mark.parametrize("arch", ARCHS)
def test_planner_bytes_equal_the_models_cache(checkpoints, arch):
    folder, _ = checkpoints[arch]
    model = load_model(folder)
    tokens = 20  # longer than the test windows (4)
    with torch.no_grad():
        cache = model(torch.randint(3, 259, (1, tokens))).past_key_values
    shape = KVShape.from_config(folder)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
    )
    assert cache.nbytes_used == shape.bytes(tokens, dtype="float32")
