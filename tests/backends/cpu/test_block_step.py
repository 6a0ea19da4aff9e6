"""Weights kept as a GGUF file's blocks: the kernels' products against the format's own library's
dequantization (the `gguf` package), and the block step's decode, prompts and engine steps
against the model's exact float path on the same blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_files import quantize_blocks, write_gguf
from tiny_models import hf_model, save_checkpoint

from kvcache import generate, load_model
from kvcache.backends import choose_backend
from kvcache.backends.cpu import numba_products
from kvcache.backends.cpu.block_step import BlockBackend
from kvcache.cache.factory import make_cache
from kvcache.model.gguf_file import held_bytes
from kvcache.model.quantized import STORED_KINDS, QuantizedEmbedding, QuantizedLinear, block_weights

pytestmark = pytest.mark.skipif(not numba_products.available(), reason="numba with OpenMP/TBB threads")
KINDS = sorted(STORED_KINDS)


def _blocks(rng, kind: str, rows: int, columns: int) -> np.ndarray:
    blocks = quantize_blocks(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    blocks.setflags(write=False)  # as a mapped file's are
    return blocks


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_tests_k_quant_blocks_are_the_formats_own(kind):
    """The K-quants written here (the `gguf` package only reads them) decode, by the format's own
    library, to the values they were made from within each block's rounding step."""
    values = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    blocks = quantize_blocks(values, kind)
    assert blocks.shape == (3, 2 * STORED_KINDS[kind][1]) and blocks.dtype == np.uint8
    back = dequantize(blocks, GGMLQuantizationType[kind])
    levels = 64 if kind == "Q6_K" else 32 if kind == "Q5_K" else 16
    assert np.abs(back - values).max() <= 2.5 * (values.max() - values.min()) / levels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_a_product_of_blocks_equals_the_dequantized_weights_product(kind, seed):
    rng = np.random.default_rng(seed)
    rows_a, rows_b, blocks, count = (int(n) for n in rng.integers([1, 1, 1, 1], [40, 9, 7, 7]))
    columns = STORED_KINDS[kind][0] * blocks
    parts = [_blocks(rng, kind, rows, columns) for rows in (rows_a, rows_b)]
    x = rng.standard_normal((count, columns)).astype(np.float32)
    bias = rng.standard_normal(rows_a + rows_b).astype(np.float32)
    weight = np.concatenate([dequantize(p, GGMLQuantizationType[kind]) for p in parts]).astype(np.float64)
    expected = x.astype(np.float64) @ weight.T + bias
    ours = numba_products.product(x, tuple(numba_products.block_part_of(p, kind) for p in parts), bias)
    scale = np.abs(x).astype(np.float64) @ np.abs(weight).T + np.abs(bias)  # error bound's scale
    assert ours.shape == expected.shape
    assert np.all(np.abs(ours - expected) <= 1e-5 * scale + 1e-6), np.abs(ours - expected).max()


@pytest.fixture(scope="module")
def block_files(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("blocks")
    files = {kind: write_gguf(checkpoints["llama"][0], root / f"{kind}.gguf", tensor_type=kind)
             for kind in ("Q8_0", "Q4_1", "Q5_0")}
    wide = save_checkpoint(hf_model("llama", hidden_size=256, intermediate_size=512), root / "wide")
    for kind in ("Q4_K", "Q5_K", "Q6_K"):  # (rows of 256 values: a model 256 wide)
        files[kind] = write_gguf(wide, root / f"{kind}.gguf", tensor_type=kind)
    return files


def test_a_gguf_keeps_its_quantized_weights_as_mapped_blocks(block_files):
    model = load_model(block_files["Q4_1"])
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 7 * model.config.num_hidden_layers + 1  # and the head (here not tied)
    down = model.model.layers[0].mlp.down_proj.weight_blocks.blocks
    assert not down.flags.owndata and not down.flags.writeable  # a view of the mapped file
    assert "Q4_1" in model.weights_note and "kept as stored blocks" in model.weights_note
    held = sum(w.nbytes for w in {id(w): w for w in block_weights(model).values()}.values())
    held += sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == held_bytes(block_files["Q4_1"])  # what `kvcache memory --weights stored` counts
    exact = load_model(block_files["Q4_1"], dtype="float32")  # every weight dequantized
    assert not any(isinstance(m, QuantizedLinear) for m in exact.modules())
    ids = torch.tensor([[1, 5, 77, 200, 3, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, exact(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_block_step_decodes_as_the_models_own_forward_on_the_same_blocks(block_files, kind):
    model = load_model(block_files[kind])
    backend = choose_backend(model)
    assert isinstance(backend, BlockBackend)
    prompts = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    for rows in (prompts[:1], prompts):  # one row on the kernels' layer calls, two on products
        ours = generate(model, rows, max_new_tokens=12, backend="auto", eos_token_id=())
        theirs = generate(model, rows, max_new_tokens=12, backend="torch", eos_token_id=())
        assert ours.backend == "blocks"
        assert torch.equal(ours.sequences, theirs.sequences)
    with torch.no_grad():  # one decode step's logits, each after the same prefill
        caches = [make_cache("dynamic", config=model.config, dtype=torch.float32, device="cpu")
                  for _ in range(2)]
        for cache in caches:
            model(prompts, past_key_values=cache)
        step = torch.tensor([[5], [9]])
        theirs = model(step, past_key_values=caches[1]).logits[:, -1]
        torch.testing.assert_close(backend.decode(step, caches[0]), theirs, atol=2e-4, rtol=1e-4)


def test_the_engine_serves_kept_blocks_on_the_block_step_as_the_exact_path_answers(block_files):
    """The engine's step on blocks (decode rows and prompt chunks together on the kernels), with
    prefix sharing and a pool small enough to preempt: greedy tokens equal the model's own forward
    on the same blocks, run alone."""
    from kvcache.engine import Engine

    model = load_model(block_files["Q4_1"])
    engine = Engine(model, num_blocks=14, block_size=4, max_running=3, token_budget=24)
    assert engine.backend.name == "blocks"
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 259, (9,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 259, (n,), generator=generator).tolist() for n in (2, 14, 5)]
    prompts.append(torch.randint(3, 259, (21,), generator=generator).tolist())
    handles = [engine.submit(prompt, max_tokens=8, ignore_eos=True) for prompt in prompts]
    for prompt, handle in zip(prompts, handles):
        solo = generate(model, torch.tensor([prompt]), max_new_tokens=8, eos_token_id=(), backend="torch")
        assert handle.result().tokens == solo.new_tokens[0], prompt
    engine.close()
    for allocator in engine.pool.cache.allocators:
        assert allocator.num_in_use == 0
