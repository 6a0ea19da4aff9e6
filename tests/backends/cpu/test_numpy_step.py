"""The numpy decode step computes what the model's forward computes, on any shape the model takes.

One random model, two caches of the same kind filled by the same prefill: decode steps of B rows
(B in 1, 3, 8, each row at its own length) run on the numpy backend and on the torch backend
(the model's forward), its one-row products numba's or numpy's (where numba has no OpenMP pool).
Logits agree to float32 rounding, and so does what each cache holds, for
every cache kind, left-padded rows, a paged cache's rows at their own lengths, grouped-query
attention, biases, tied embeddings and sliding-window layers; and each row's last logits equal a
solo forward of that row's whole sequence without a cache (the naive reference).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import random_model, tiny_config

from kvcache.backends import BackendError, NumpyBackend, TorchBackend
from kvcache.backends.cpu import numba_products
from kvcache.cache import QuantizedCache, make_cache
from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcache.model import ConfigError, ModelConfig, RopeScaling

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def _config(draw) -> ModelConfig:
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    window = draw(st.none() | st.integers(2, 6))
    bias = draw(st.sampled_from(["none", "qkv", "all"]))
    return ModelConfig(
        model_type="llama" if window is None else "mistral",
        vocab_size=draw(st.integers(8, 40)),
        hidden_size=draw(st.sampled_from([8, 16, 24])),
        intermediate_size=draw(st.integers(4, 40)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([4, 8, 16])),
        max_position_embeddings=64,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
        tie_word_embeddings=draw(st.booleans()),
        qkv_bias=bias != "none",
        o_bias=bias == "all",
        mlp_bias=bias == "all",
        qk_norm=draw(st.sampled_from([None, "head"])),  # qwen3's per-head q/k norms, on any shape
        sliding_window=window,
        layer_types=tuple(
            draw(st.sampled_from([FULL_ATTENTION, SLIDING_ATTENTION])) if window else FULL_ATTENTION
            for _ in range(layers)
        ),
    )


@st.composite
def cases(draw):
    config = _config(draw)
    kinds = ["dynamic", "static", "static_compiled", "quantized", "paged", "none"]
    if FULL_ATTENTION not in config.layer_types:
        kinds += ["sliding", "sliding_compiled"]  # its rings window every layer
    batch = draw(st.sampled_from([1, 3, 8]))
    return dict(
        config=config,
        cache=draw(st.sampled_from(kinds)),
        lengths=[draw(st.integers(1, 7)) for _ in range(batch)],
        steps=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 2**16)),
        products=draw(st.sampled_from(["numba", "numpy"])),
    )


def numpy_backend(model, products: str = "numba") -> NumpyBackend:
    """A NumpyBackend whose one-row steps run on numba's kernels, or on numpy's operations and
    products as where numba has no OpenMP pool."""
    if products == "numba":
        assert numba_products.available()  # (else this environment tests only the numpy side)
        return NumpyBackend(model)
    with mock.patch.object(numba_products, "available", lambda: False):
        return NumpyBackend(model)


def _cache(kind: str, model, batch: int, max_length: int):
    if kind == "quantized":  # a short residual, so the history is quantized within the test
        return QuantizedCache(config=model.config, bits=8, group_size=2, residual_length=2)
    compiled = {"compiled": True} if kind.endswith("_compiled") else {}  # whole buffers, masked
    return make_cache(
        kind.removesuffix("_compiled"), config=model.config, dtype=model.dtype, max_batch_size=batch,
        max_cache_len=max_length, **compiled,
    )


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_numpy_step_equals_the_torch_forward_and_the_solo_no_cache_run(case):
    config, lengths, kind = case["config"], case["lengths"], case["cache"]
    batch, steps = len(lengths), case["steps"]
    model = random_model(config, case["seed"])
    numpy, torch_step = numpy_backend(model, case["products"]), TorchBackend(model)
    assert (numpy.row_layers is not None) == (case["products"] == "numba")
    generator = torch.Generator().manual_seed(case["seed"])
    rows = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    ids, mask = _left_padded(rows)
    # dense caches see the rows left-padded, with a growing mask; a paged cache keeps each row at
    # its own length and decodes without a mask
    # (a cache that keeps nothing sees each step's token alone, with no mask)
    grows = kind not in ("paged", "none") and bool((mask == 0).any())
    caches = {}
    with torch.inference_mode():
        for name in ("numpy", "torch"):
            caches[name] = _cache(kind, model, batch, ids.shape[1] + steps)
            model(ids, attention_mask=mask, past_key_values=caches[name])
        step_mask = mask
        for _ in range(steps):
            token = torch.randint(0, config.vocab_size, (batch, 1), generator=generator)
            for row, chosen in zip(rows, token[:, 0].tolist()):
                row.append(chosen)
            step_mask = torch.cat([step_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            given_mask = step_mask if grows else None
            ours = numpy.decode(token, caches["numpy"], given_mask)
            theirs = torch_step.decode(token, caches["torch"], given_mask)
            assert ours.shape == (batch, config.vocab_size) and ours.dtype == torch.float32
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        if kind == "none":
            return  # it keeps nothing: each step saw only its own token, on both backends alike
        for layer in range(config.num_hidden_layers):
            mine, reference = caches["numpy"].layers[layer], caches["torch"].layers[layer]
            assert mine.get_seq_length() == reference.get_seq_length()
            torch.testing.assert_close(mine.keys, reference.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, reference.values, atol=1e-5, rtol=1e-5)
        if kind == "quantized":
            return  # lossy: its logits differ from the full-precision reference by design
        # the last step fed each row's last token: its logits are those of a solo forward of the
        # row's whole sequence, unpadded, without a cache
        for index, row in enumerate(rows):
            solo = model(torch.tensor([row]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(ours[index], solo, atol=1e-4, rtol=1e-4)


def _decode_after(backend, model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, vocab) of one decode step on `backend` after a prefill of ids[:, :-1]."""
    with torch.inference_mode():
        cache = make_cache("dynamic", config=model.config)
        model(ids[:, :-1], past_key_values=cache)
        return backend.decode(ids[:, -1:], cache)


def test_one_row_runs_numpys_products_and_several_rows_onednns_on_a_copy_made_once():
    model = random_model(tiny_config(), 9)
    backend = NumpyBackend(model)
    laid_out = backend._laid_out  # made with the backend
    assert laid_out is not None
    assert backend.products(1)[0] is backend.layers  # one row: numpy's, on the model's own memory
    assert backend.products(3)[0] is laid_out[0]
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(5))
    for rows in (ids[:1], ids):
        torch.testing.assert_close(
            _decode_after(backend, model, rows), _decode_after(TorchBackend(model), model, rows),
            atol=1e-4, rtol=1e-4)
    assert backend._laid_out is laid_out  # kept
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)  # in place: the packed arrays see it
    for rows in (ids[:1], ids):  # so do both paths (the copy is made again)
        torch.testing.assert_close(
            _decode_after(backend, model, rows), _decode_after(TorchBackend(model), model, rows),
            atol=1e-4, rtol=1e-4)
    assert backend._laid_out is not laid_out


def test_the_rope_table_grows_past_its_first_block():
    model = random_model(tiny_config(max_position_embeddings=1024), 8)
    ids = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(4))
    ours = _decode_after(NumpyBackend(model), model, ids)  # position 299: past the first 256 rows
    torch.testing.assert_close(ours, _decode_after(TorchBackend(model), model, ids), atol=1e-4, rtol=1e-4)


def test_a_dynamic_rope_model_checks_its_range_on_both_backends():
    """Dynamic NTK scaling is refused past max_position_embeddings on both paths alike."""
    config = ModelConfig(
        model_type="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=4,
        rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0),
        layer_types=(FULL_ATTENTION,),
    )
    model = random_model(config, 5)
    logits = {}
    for backend in (NumpyBackend(model), TorchBackend(model)):
        logits[backend.name] = _decode_after(backend, model, torch.tensor([[1, 2, 3, 4]]))
        with pytest.raises(ConfigError, match="dynamic RoPE scaling"):
            _decode_after(backend, model, torch.tensor([[1, 2, 3, 4, 5]]))
    torch.testing.assert_close(logits["numpy"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_out_of_range_ids_are_refused_like_the_embedding_refuses_them():
    model = random_model(tiny_config(), 9)
    backend = NumpyBackend(model)
    with torch.inference_mode():
        cache = model(torch.tensor([[1, 2]])).past_key_values
        for bad in (-1, 64):
            with pytest.raises(IndexError, match="token ids must lie in"):
                backend.decode(torch.tensor([[bad]]), cache)
        with pytest.raises(ValueError, match=r"\(batch, 1\)"):
            backend.decode(torch.tensor([[1, 2]]), cache)


def test_a_model_it_cannot_stand_in_for_is_refused_with_the_reason():
    """The step calls no module, so it refuses a model whose modules would do more than the
    forwards it computes, and weights it cannot read: a named error, never a silent bypass."""
    from kvcache.model.llama import MLP

    model = random_model(tiny_config(), 10)
    layer = model.model.layers[1]
    handles = [
        lambda: layer.register_forward_hook(lambda *args: None),
        lambda: layer.mlp.register_forward_pre_hook(lambda *args: None),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda *args: None),
    ]
    for register in handles:
        handle = register()
        try:
            with pytest.raises(BackendError, match="hook"):
                NumpyBackend(model)
        finally:
            handle.remove()
    layer.forward = lambda *args, **kwargs: None
    with pytest.raises(BackendError, match="its own forward"):
        NumpyBackend(model)
    del layer.forward

    class LoudMLP(MLP):
        def forward(self, x):
            return 3 * super().forward(x)

    old = layer.mlp
    layer.mlp = LoudMLP(model.config)
    with pytest.raises(BackendError, match="LoudMLP"):
        NumpyBackend(model)
    layer.mlp = old
    with pytest.raises(BackendError, match="float32 on CPU"):
        NumpyBackend(random_model(tiny_config(), 11).to(torch.bfloat16))
    NumpyBackend(model)  # every hook removed: accepted again
