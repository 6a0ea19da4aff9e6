"""How many weights a model of a `ModelConfig` holds, and their bytes, without building it.

The count follows the decoder's modules (`kvcache.model.llama`) one by one: embeddings, per
layer the q/k/v/o projections (with their biases where the family has them), the q/k norms, the
gated MLP and the RMSNorms where the family places them, the final norm, and `lm_head` unless it
is tied to the embeddings. `kvcache memory --weights` adds these bytes to a budget.
"""

from __future__ import annotations

from kvcache.model.config import NORM_PLACEMENTS, ModelConfig

WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parameter_count(config: ModelConfig) -> int:
    """Elements in every weight of the model `config` describes (a tied lm_head counted once)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    if config.qkv_bias:
        attention += q_width + 2 * kv_width
    if config.o_bias:
        attention += hidden
    if config.qk_norm == "head":
        attention += 2 * config.head_dim
    elif config.qk_norm == "width":
        attention += q_width + kv_width
    mlp = 3 * hidden * inner + ((2 * inner + hidden) if config.mlp_bias else 0)
    norms = len(NORM_PLACEMENTS[config.norm_placement]) * hidden
    layer = attention + mlp + norms
    embeddings = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else config.vocab_size * hidden
    return embeddings + config.num_hidden_layers * layer + hidden + head


def weight_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of the weights held in `dtype` (a key of WEIGHT_DTYPE_BYTES)."""
    if dtype not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"weights dtype must be one of {sorted(WEIGHT_DTYPE_BYTES)}, got {dtype!r}")
    return parameter_count(config) * WEIGHT_DTYPE_BYTES[dtype]
