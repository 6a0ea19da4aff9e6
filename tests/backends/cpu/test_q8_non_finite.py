"""A NaN or an inf reaches a product's outputs with Q8 activations as it does with float ones: in
an activation (the quantizers read it) or in a weight block's float16 scale (the integer dots'
sums times it), on one row's dots and on many rows' tiles, in every block format; and a model
whose GGUF weight holds one stops with `NonFiniteLogitsError`, never a finite wrong token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_files import quantize_blocks, write_gguf
from tiny_models import llama_checkpoint

from kvcache import generate, load_model
from kvcache.backends.cpu import numba_products
from kvcache.generation.sampling import NonFiniteLogitsError
from kvcache.model.quantized import STORED_KINDS, BlockWeight

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not numba_products.available(), reason="numba with OpenMP/TBB threads")]
KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
#: where a block's float16 scale d sits, and its float16 minimum (dmin for the K-quants), if any
SCALE_AT = {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}
MINIMUM_AT = {"Q4_1": 2, "Q5_1": 2, "Q2_K": 82, "Q4_K": 2, "Q5_K": 2}
#: activation rows: one row's dots, and a tile of four plus a row past it (the one-row dots again)
COUNTS = (1, 5)
WEIGHT_ROWS = 6


def _weight(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    columns = STORED_KINDS[kind][0] * 2
    return quantize_blocks(rng.standard_normal((WEIGHT_ROWS, columns)).astype(np.float32), kind)


def _products(kind: str, blocks: np.ndarray, x: np.ndarray, q8: bool) -> dict[str, np.ndarray]:
    """x times the weight on the kernels and on the modules' own numpy path."""
    blocks.setflags(write=False)  # (as a mapped file's are)
    kernels = numba_products.product(x, (numba_products.block_part_of(blocks, kind, q8),))
    activations = "q8" if q8 else "float32"
    with np.errstate(invalid="ignore", over="ignore"):
        numpy_path = BlockWeight(kind, len(blocks), x.shape[1], blocks, activations).times(x)
    return {"kernels": kernels, "numpy": numpy_path}


@pytest.mark.parametrize("kind", KINDS)
def test_with_q8_activations_a_non_finite_activation_makes_its_rows_outputs_not_finite(kind):
    blocks = _weight(kind, 1)
    rng = np.random.default_rng(2)
    for bad in (np.nan, np.inf, -np.inf):
        for count in COUNTS:
            x = rng.standard_normal((count, blocks.shape[1] // STORED_KINDS[kind][1]
                                     * STORED_KINDS[kind][0])).astype(np.float32)
            hit = [0, count - 1] if count > 1 else [0]  # (row 4: past the tile)
            x[hit, 5] = bad
            for path, out in _products(kind, blocks.copy(), x, q8=True).items():
                assert not np.isfinite(out[hit]).any(), (path, bad, count, out[hit])
                spared = np.delete(out, hit, axis=0)
                assert np.isfinite(spared).all(), (path, bad, count)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("q8", [True, False], ids=["q8", "float32"])
def test_a_non_finite_weight_scale_makes_its_rows_outputs_not_finite(kind, q8):
    """A float16 NaN or inf as one block's d (row 2) and, where the format has one, its minimum
    (row 4): every output of those rows is not finite, the others are."""
    rng = np.random.default_rng(3)
    for bad in (np.float16(np.nan), np.float16(np.inf)):
        blocks = _weight(kind, 4)
        size = STORED_KINDS[kind][1]
        scale_at = size + SCALE_AT.get(kind, 0)  # (the row's second block)
        blocks[2, scale_at : scale_at + 2] = np.array([bad]).view(np.uint8)
        hit = [2]
        if kind in MINIMUM_AT:
            blocks[4, MINIMUM_AT[kind] : MINIMUM_AT[kind] + 2] = np.array([bad]).view(np.uint8)
            hit.append(4)
        for count in COUNTS:
            x = rng.standard_normal((count, 2 * STORED_KINDS[kind][0])).astype(np.float32)
            for path, out in _products(kind, blocks.copy(), x, q8).items():
                assert not np.isfinite(out[:, hit]).any(), (path, bad, count, out[:, hit])
                assert np.isfinite(np.delete(out, hit, axis=1)).all(), (path, bad, count)


def _gguf_with_a_nan_weight(tmp_path, kind: str):
    """A tiny Llama as a GGUF of `kind` blocks whose layer-0 gate weight's row 5 has a NaN scale
    in its first block: that row's output is NaN, and the down projection reads it (Q8 activations)."""
    width = 256 if kind.endswith("_K") else 32
    sizes = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=272, max_position_embeddings=64)
    path = write_gguf(llama_checkpoint(tmp_path / "m", seed=0, **sizes), tmp_path / f"{kind}.gguf",
                      tensor_type=kind)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_gate.weight")
    row_bytes = width // STORED_KINDS[kind][0] * STORED_KINDS[kind][1]
    with open(path, "r+b") as file:
        file.seek(int(tensor.data_offset) + 5 * row_bytes + SCALE_AT.get(kind, 0))
        file.write(np.array([np.nan], np.float16).tobytes())
    return path


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_generate_with_q8_activations_stops_on_a_nan_weight_with_a_named_error(tmp_path, kind, backend):
    """backend auto: the block step's kernels; torch: the model's forward on the numpy products."""
    model = load_model(_gguf_with_a_nan_weight(tmp_path, kind), activations="q8")
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4, backend=backend, eos_token_id=())
