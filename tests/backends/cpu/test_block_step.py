"""Weights kept as a GGUF file's blocks: the kernels' products against the format's own library's
dequantization (the `gguf` package), and the block step's decode, prompts and engine steps
against the model's exact float path on the same blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from backend_runs import forward_logits, paged_logits
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_files import close_to_the_float_path, quantize_blocks, write_gguf
from tiny_models import hf_model, save_checkpoint

from kvcache import generate, load_model
from kvcache.backends import choose_backend
from kvcache.backends.cpu import numba_products
from kvcache.backends.cpu.block_step import BlockBackend
from kvcache.model.fingerprint import model_fingerprint
from kvcache.model.gguf_file import held_bytes
from kvcache.model.quantized import (
    STORED_KINDS,
    BlockWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    block_weights,
)

pytestmark = [pytest.mark.skipif(not numba_products.available(), reason="numba with OpenMP/TBB threads"),
              pytest.mark.kernels]  # (kernels: not in pytest --fast)
KINDS = sorted(STORED_KINDS)


def _blocks(rng, kind: str, rows: int, columns: int) -> np.ndarray:
    blocks = quantize_blocks(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    blocks.setflags(write=False)  # as a mapped file's are
    return blocks


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_tests_k_quant_blocks_are_the_formats_own(kind):
    """The K-quants written here (the `gguf` package only reads them) decode, by the format's own
    library, to the values they were made from within each block's rounding step."""
    values = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    blocks = quantize_blocks(values, kind)
    assert blocks.shape == (3, 2 * STORED_KINDS[kind][1]) and blocks.dtype == np.uint8
    back = dequantize(blocks, GGMLQuantizationType[kind])
    levels = {"Q2_K": 4, "Q3_K": 8, "Q4_K": 16, "Q5_K": 32, "Q6_K": 64}[kind]
    assert np.abs(back - values).max() <= 2.5 * (values.max() - values.min()) / levels


Q8_KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _as_llama_cpp_reads(x: np.ndarray, parts: list[np.ndarray], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(x as llama.cpp's CPU products read it, float64; what each block's float16 minimum adds to
    the product, (N, out) float64), from the formats' rules: a 32-value format's activations are
    Q8_0 (Q8_1 for Q4_1, Q5_1): each 32 values q = round(x · 127 / max|x|), d = max|x| / 127
    stored as float16; Q8_1 also s = float16(d · Σq), which the minimum multiplies. A K-quant's
    are Q8_K: each 256 values q = min(127, round(x · -127 / m)), m the first value of the largest
    magnitude, d = 1 / (-127 / m) as float32."""
    if kind.endswith("_K"):
        read = []
        for block in x.astype(np.float32).reshape(-1, 256):
            m = block[np.argmax(np.abs(block))]
            s = np.float32(-127.0) / m if m != 0 else np.float32(0.0)
            q = np.minimum(np.rint(block * s), 127.0)
            read.append(q.astype(np.float64) * (np.float64(np.float32(1.0) / s) if m != 0 else 0.0))
        return np.concatenate(read).reshape(x.shape), 0.0
    groups = x.astype(np.float32).reshape(len(x), -1, 32)
    largest = np.abs(groups).max(axis=2, keepdims=True)
    safe = np.where(largest > 0, largest, np.float32(1.0))
    q = np.where(largest > 0, np.rint(groups * (np.float32(127.0) / safe)), 0.0)
    d = largest / np.float32(127.0)
    read = (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    if kind not in ("Q4_1", "Q5_1"):
        return read, 0.0
    s = (d[:, :, 0] * q.sum(axis=2)).astype(np.float16).astype(np.float64)  # (N, blocks)
    size = STORED_KINDS[kind][1]
    minimums = np.concatenate([p.reshape(len(p), -1, size)[:, :, 2:4].copy().view(np.float16)[:, :, 0]
                               for p in parts]).astype(np.float64)  # (out, blocks)
    return read, (s - read.reshape(len(x), -1, 32).sum(axis=2)) @ minimums.T


def _products_against(kind: str, seed: int, q8: bool) -> None:
    """A random product of two stacked parts, on the kernels (the seed's count of activation
    rows: one row's dots or many rows' tiles) and on the modules' own numpy path, against the
    `gguf` package's dequantized weight times x (q8: x as llama.cpp reads it, plus m·s)."""
    rng = np.random.default_rng(seed)
    rows_a, rows_b, blocks, _ = (int(n) for n in rng.integers([1, 1, 1, 1], [40, 9, 7, 7]))
    count = (1, 5, 3, 6)[seed % 4]  # activation rows: one row's dots (below MANY_ROWS) and tiles
    columns = STORED_KINDS[kind][0] * blocks
    parts = [_blocks(rng, kind, rows, columns) for rows in (rows_a, rows_b)]
    x = rng.standard_normal((count, columns)).astype(np.float32)
    x[0, : STORED_KINDS[kind][0]] = 0.0  # (a block of zeros: Q8's scale 0)
    bias = rng.standard_normal(rows_a + rows_b).astype(np.float32)
    weight = np.concatenate([dequantize(p, GGMLQuantizationType[kind]) for p in parts]).astype(np.float64)
    read, minimum_shares = _as_llama_cpp_reads(x, parts, kind) if q8 else (x.astype(np.float64), 0.0)
    expected = read @ weight.T + minimum_shares + bias
    ours = numba_products.product(x, tuple(numba_products.block_part_of(p, kind, q8) for p in parts), bias)
    activations = "q8" if q8 else "float32"
    numpy_path = np.concatenate(
        [BlockWeight(kind, len(p), columns, p, activations).times(x) for p in parts], axis=1
    ) + bias
    scale = np.abs(x).astype(np.float64) @ np.abs(weight).T + np.abs(bias)  # error bound's scale
    for got in (ours, numpy_path):
        assert got.shape == expected.shape
        assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-6), np.abs(got - expected).max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_a_product_of_blocks_equals_the_dequantized_weights_product(kind, seed):
    _products_against(kind, seed, q8=False)


@pytest.mark.parametrize("kind", Q8_KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_with_q8_activations_a_product_is_llama_cpps(kind, seed):
    """x read as llama.cpp's CPU products read it (integer dots on the kernels), times the
    dequantized weight."""
    _products_against(kind, seed, q8=True)


@pytest.mark.parametrize("kind", Q8_KINDS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tiles", [False, True])
def test_with_q8_activations_a_rows_product_does_not_depend_on_the_rows_beside_it(kind, seed, tiles):
    """Each activation row's outputs are the same to the bit whether it is multiplied alone (a
    decode step's dots) or among others (a prompt's 4x4 tiles, or from TILE_ROWS rows the matrix
    unit's where it has one): one arithmetic for a token's products wherever it runs, as
    llama.cpp's products per row are."""
    if tiles and numba_products.matrix_unit() is None:
        pytest.skip("this CPU has no AMX tiles (or the kernel refused them)")
    rng = np.random.default_rng(100 + seed)
    columns = STORED_KINDS[kind][0] * int(rng.integers(1, 6))
    rows, count = int(rng.integers(1, 30)), (4, 9, 16)[seed]
    part = numba_products.block_part_of(_blocks(rng, kind, rows, columns), kind, q8=True, tiles=tiles)
    x = (rng.standard_normal((count, columns)) * rng.gamma(1.0, 1.0, columns)).astype(np.float32)
    together = numba_products.product(x, (part,))
    alone = np.concatenate([numba_products.product(x[n : n + 1], (part,)) for n in range(count)])
    assert np.array_equal(together, alone), np.abs(together - alone).max()


def q8_dots_against_llama_cpps_rules() -> bool:
    """Each 32-value format's four-row dot (`numba_q8`'s intrinsics, as the target CPU compiles
    them) on random blocks against x as llama.cpp reads it times the dequantized rows; returns
    whether they ran on VNNI."""
    import numba

    from kvcache.backends.cpu import numba_q8

    dots = {"Q8_0": numba_q8.q8_0_rows, "Q4_0": numba_q8.q4_0_rows, "Q4_1": numba_q8.q4_1_rows,
            "Q5_0": numba_q8.q5_0_rows, "Q5_1": numba_q8.q5_1_rows, "Q2_K": numba_q8.q2_k_rows,
            "Q3_K": numba_q8.q3_k_rows, "Q4_K": numba_q8.q4_k_rows, "Q5_K": numba_q8.q5_k_rows,
            "Q6_K": numba_q8.q6_k_rows}
    rng = np.random.default_rng(7)
    for kind, dot in dots.items():
        def four(w, quants, scales, counts, shifts, dot=dot):
            return dot(w, np.int64(0), np.int64(1), np.int64(2), np.int64(3), quants, scales, counts, shifts)

        columns = STORED_KINDS[kind][0] * 2
        w = _blocks(rng, kind, 4, columns)
        x = rng.standard_normal((1, columns)).astype(np.float32)
        quants = np.empty(x.shape, np.int8)
        if kind.endswith("_K"):
            scales, counts, shifts = (np.empty((1, columns // n), np.float32) for n in (256, 16, 1 << 30))
            numba_q8.q8_k_activations(x, quants, scales, counts)
        else:
            scales, counts, shifts = (np.empty((1, columns // 32), np.float32) for _ in range(3))
            numba_q8.q8_activations(x, quants, scales, counts, shifts)
        got = np.array(numba.njit(four)(w, quants[0], scales[0], counts[0], shifts[0]), np.float64)
        read, minimum_shares = _as_llama_cpp_reads(x, [w], kind)
        weight = dequantize(w, GGMLQuantizationType[kind]).astype(np.float64)
        expected = (read @ weight.T + minimum_shares)[0]
        scale = np.abs(x[0]).astype(np.float64) @ np.abs(weight).T
        assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-6), (kind, got, expected)
        tiles_equal_one_row_dots(rng, kind, w, four)
    return numba_q8.VNNI


def tiles_equal_one_row_dots(rng, kind: str, w: np.ndarray, four) -> None:
    """The tiles' intrinsics (four weight rows' values unpacked once, then four activation rows
    a call) give each pair of rows the one-row dots' float32, to the bit."""
    import numba

    from kvcache.backends.cpu import numba_q8

    name = kind.lower()
    unpack, tile = getattr(numba_q8, f"{name}_unpack"), getattr(numba_q8, f"{name}_tile")
    x = (rng.standard_normal((4, w.shape[1] // STORED_KINDS[kind][1] * STORED_KINDS[kind][0]))
         * 3.0).astype(np.float32)
    group = STORED_KINDS[kind][0]
    quants = np.empty(x.shape, np.int8)
    scales = np.empty((4, x.shape[1] // group), np.float32)
    if kind.endswith("_K"):
        counts, shifts = np.empty((4, x.shape[1] // 16), np.float32), np.empty((4, 0), np.float32)
        numba_q8.q8_k_activations(x, quants, scales, counts)
    else:
        counts, shifts = (np.empty((4, x.shape[1] // 32), np.float32) for _ in range(2))
        numba_q8.q8_activations(x, quants, scales, counts, shifts)

    def tiled(w, quants, scales, counts, shifts, unpack=unpack, tile=tile):
        values = np.empty((4, quants.shape[1]), np.uint8)
        i = np.int64(0)
        unpack(w, i, i + 1, i + 2, i + 3, values)
        return tile(w, i, i + 1, i + 2, i + 3, values, quants, scales, counts, shifts, i)

    together = numba.njit(tiled)(w, quants, scales, counts, shifts)
    jitted = numba.njit(four)
    alone = [value for n in range(4) for value in jitted(w, quants[n], scales[n], counts[n], shifts[n])]
    assert np.array_equal(np.array(together, np.float32), np.array(alone, np.float32)), kind


def test_q8_dots_match_llama_cpps_rules_with_and_without_vnni():
    """The dots as this CPU compiles them, and again for a CPU without VNNI (numba told it is a
    Haswell, in a child process: the 16-bit pair sums), both against the formats' rules."""
    q8_dots_against_llama_cpps_rules()
    here = Path(__file__).parent
    script = "import test_block_step as t; print('VNNI', t.q8_dots_against_llama_cpps_rules())"
    child = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "",
             "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])},
        capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-2:] == ["VNNI", "False"]


def test_vnni_is_read_from_the_features_numba_compiles_for(monkeypatch):
    from kvcache.backends.cpu import numba_q8

    monkeypatch.setattr(numba_q8.numba.config, "CPU_FEATURES", "+avx2,+avxvnni")
    assert numba_q8.target_has_vnni()
    monkeypatch.setattr(numba_q8.numba.config, "CPU_FEATURES", "+avx2,+avx512vnni")  # no AVX512VL
    assert not numba_q8.target_has_vnni()
    monkeypatch.setattr(numba_q8.numba.config, "CPU_FEATURES", "+avx512vl,+avx512vnni")
    assert numba_q8.target_has_vnni()
    monkeypatch.setattr(numba_q8.numba.config, "CPU_FEATURES", None)  # the host's, as numba reads them
    monkeypatch.setattr(numba_q8.numba.config, "ENABLE_AVX", False)
    assert not numba_q8.target_has_vnni()


def test_bad_activation_settings_are_refused(block_files, checkpoints):
    blocks = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="q8"):
        BlockWeight("Q4_K", 2, 256, blocks, "int4")
    with pytest.raises(ValueError, match="activations"):
        load_model(block_files["Q4_1"], activations="int4")
    with pytest.raises(ValueError, match="without a dtype"):
        load_model(block_files["Q4_1"], dtype="float32", activations="q8")
    with pytest.raises(ValueError, match="folder"):
        load_model(checkpoints["llama"][0], activations="q8")


@pytest.fixture(scope="module")
def block_files(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("blocks")
    files = {kind: write_gguf(checkpoints["llama"][0], root / f"{kind}.gguf", tensor_type=kind)
             for kind in ("Q8_0", "Q4_1", "Q5_0")}
    wide = save_checkpoint(hf_model("llama", hidden_size=256, intermediate_size=512), root / "wide")
    for kind in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):  # (rows of 256 values: a model 256 wide)
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
        rounded = load_model(block_files["Q4_1"], activations="q8")
        assert "rounded to 8 bits as llama.cpp's" in rounded.weights_note
        close_to_the_float_path(rounded(ids).logits, exact(ids).logits)  # the modules' numpy path
        no_steps = torch.empty((1, 0), dtype=torch.long)  # the prompt on the kernels' integer dots
        ours = paged_logits(rounded, choose_backend(rounded), ids, no_steps)[0]
        close_to_the_float_path(ours, exact(ids).logits[:, -1])
    # keys and values a q8 run saves are never read by a float run of the same file
    assert len({model_fingerprint(m) for m in (model, rounded, exact)}) == 3


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_block_step_decodes_as_the_models_own_forward_on_the_same_blocks(block_files, kind):
    model = load_model(block_files[kind])
    backend = choose_backend(model)
    assert isinstance(backend, BlockBackend)
    prompts = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    for rows in (prompts[:1], prompts):  # one row, two rows
        ours = generate(model, rows, max_new_tokens=12, backend="auto", eos_token_id=())
        theirs = generate(model, rows, max_new_tokens=12, backend="torch", eos_token_id=())
        assert ours.backend == "blocks"
        assert torch.equal(ours.sequences, theirs.sequences)
    step = torch.tensor([[5], [9]])  # the prompt's logits, then one decode step's
    ours, theirs = paged_logits(model, backend, prompts, step), forward_logits(model, prompts, step)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, atol=2e-4, rtol=1e-4)


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


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_a_prompts_chunks_run_on_the_matrix_unit_where_there_is_one_and_give_one_token_steps_logits(
    block_files, kind
):
    """With q8 activations and AMX tiles (`on_tiles`: the parts coded for them), a prompt fed in
    chunks of 16 tokens (the layer kernels, their products on the tiles), of 24 and whole (long
    steps: products outside the layer calls, the kernels' norms and attention per token) gives
    the logits, to the bit, of the same prompt fed a token at a time (the one-row dots): one
    arithmetic whatever the step's size."""
    from kvcache.backends.cpu.numba_blocks import TILE_READS

    model = load_model(block_files[kind], activations="q8")
    backend = choose_backend(model)
    assert backend.on_tiles == (numba_products.matrix_unit() is not None)
    codes = {code for _, code in backend.row_layers[0][0].qkv}
    assert all((code >= TILE_READS) == backend.on_tiles for code in codes)
    prompt = torch.randint(0, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(6))
    assert backend.chunk_invariant
    single = paged_logits(model, backend, prompt, tokens, chunk_size=1)
    for chunk_size in (16, 24, None):
        chunked = paged_logits(model, backend, prompt, tokens, chunk_size=chunk_size)
        assert all(torch.equal(a, b) for a, b in zip(chunked, single)), chunk_size
    order_free = BlockBackend(model, exact_prompts=False)  # (named: a long step on torch's attention)
    assert not order_free.chunk_invariant
    whole = paged_logits(model, order_free, prompt, tokens)
    for mine, exact in zip(whole, single):
        torch.testing.assert_close(mine, exact, atol=2e-4, rtol=1e-4)
