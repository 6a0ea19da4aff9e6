"""ArrayStep: a decode step whose per-token arithmetic runs on numpy float32 rows.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
array_step.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.cpu import numba_products, paged_step
from kvcache.backends.cpu.rows import rms_norm, rotate, swiglu
from kvcache.backends.cpu.threads import torch_threads
from kvcache.backends.torch_step import forward_rows
from kvcache.cache import PagedBatch, PagedCache

_ALL_VISIBLE = np.empty(0, np.bool_)  # the kernels' "no mask"


class ArrayStep(DecodeBackend):
    """The step's arithmetic on numpy rows (see the module docstring). A subclass sets `layers`
    (each with norm1, norm2, q_norm, k_norm as float32 arrays or None, and the products' weights
    qkv, o, gate_up, down with their biases), `final_norm` and `lm_head`, and implements
    `_linear`, `embed_rows` and `_store`."""

    layers: list
    final_norm: np.ndarray
    lm_head: object

    def __init__(self, model) -> None:
        config = model.config
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.group = self.heads // self.kv_heads
        self.eps = float(model.model.norm.eps)  # every RMSNorm's (unsupported_structure checked)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.vocab = model.model.embed_tokens.num_embeddings  # the ids an embedding row exists for
        self.rotary = model.model.rotary_emb  # its table is built from the model's own frequencies
        empty = np.zeros((0, self.head_dim), np.float32)
        self._cos, self._signed_sin = empty, empty  # the RoPE table, grown on demand
        self._buffers = [(buffer, buffer.data_ptr()) for buffer in model.buffers()]

    def same_model_config(self, model) -> bool:
        """Whether `model` has the config and eps this step was built for, and every buffer (the
        RoPE frequencies) is still the one it read (an in-place write to one is not seen)."""
        buffers = list(model.buffers())
        return (
            model.config == self.config
            and float(model.model.norm.eps) == self.eps
            and len(buffers) == len(self._buffers)
            and all(b is mine and b.data_ptr() == ptr for b, (mine, ptr) in zip(buffers, self._buffers))
        )

    def remember_parameters(self, model) -> None:
        """Note `model`'s parameters as they are now: each one, its memory and its version
        counter (`same_parameters` compares against them)."""
        self._sources = [(p, p.data_ptr(), p._version) for p in model.parameters()]

    def same_parameters(self, model) -> bool:
        """Whether every parameter of `model` is the one `remember_parameters` noted, in place
        and unwritten since."""
        parameters = list(model.parameters())
        return len(parameters) == len(self._sources) and all(
            p is mine and p.data_ptr() == ptr and p._version == version
            for p, (mine, ptr, version) in zip(parameters, self._sources)
        )

    # ---- what a backend supplies ----------------------------------------------------------------
    def products(self, batch: int) -> tuple[list, object, object]:
        """(layers, lm_head, linear) for a step of `batch` rows: here always the backend's own
        `layers`, `lm_head` and `_linear`."""
        return self.layers, self.lm_head, self._linear

    #: (layers as `numba_products.RowLayer`, lm_head as (parts, bias), what their products round
    #: to: `numba_products.rounding_of`) for one-row steps on numba's kernels, set by a subclass
    #: that has them
    row_layers: tuple[list, tuple, int] | None = None

    def _numba_step(self, batch: int) -> bool:
        """Whether a step of `batch` rows runs on numba's kernels (at any cache length)."""
        return self.row_layers is not None and batch == 1

    def _on_torch_threads(self, batch: int) -> bool:
        """Whether a step of `batch` rows runs its products on torch's threads (oneDNN's, torch's
        F.linear)."""
        return True

    def _threads(self, batch: int) -> int | None:
        """torch's CPU threads during a step of `batch` rows, called as the step starts: the
        caller's (None) when the products run on torch's threads, else one (numba's or
        OpenBLAS's threads run them, and a second pool spinning beside theirs makes both wait),
        numba's then set to the caller's torch thread count."""
        if self._on_torch_threads(batch):
            return None
        if self._numba_step(batch):
            numba_products.set_threads(torch.get_num_threads())
        return 1

    def _linear(self, x: np.ndarray, weight, bias) -> np.ndarray:
        """x (B, in) float32 through one of the step's products -> (B, out) float32."""
        raise NotImplementedError

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding rows of token_ids (B,) as a new float32 array (B, hidden)."""
        raise NotImplementedError

    def _store(self, cache, k: np.ndarray, v: np.ndarray, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, H_kv, 1, D) float32 to layer `index` of the cache; return the keys and
        values attention reads, (B, H_kv, T_kv, D) tensors in the cache's dtype."""
        raise NotImplementedError

    def _store_rows(self, cache, k: np.ndarray, v: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
        """`_store` for numba's kernels: the keys and values as numpy (1, H_kv, T_kv, D), float32,
        bfloat16 bits (uint16) or float16 bits (int16)."""
        raise NotImplementedError

    # ---- RoPE --------------------------------------------------------------------------------
    def _extend_rope_table(self, needed: int) -> None:
        """cos and signed sin (N, D) of positions 0..N-1 for N >= needed (doubling), from the
        model's own RotaryEmbedding. Its range check (dynamic scaling stops at
        max_position_embeddings) applies: the table never grows past that limit, and a position
        beyond it raises as on the torch path."""
        size = max(needed, 2 * len(self._cos), 256)
        if self.rotary.limit is not None:
            size = max(needed, min(size, self.rotary.limit))
        cos, signed_sin = self.rotary(torch.arange(size)[None], torch.float32)  # (1, 1, N, D)
        self._cos, self._signed_sin = cos[0, 0].numpy(), signed_sin[0, 0].numpy()

    # ---- the step ------------------------------------------------------------------------------
    #: a step of up to this many tokens runs every product on numba's kernels (`paged_step`);
    #: more, on `products`
    kernel_rows: int = 16

    def step(self, model, batch) -> torch.Tensor:
        """One engine step (`DecodeBackend.step`): every row on numba's kernels, reading and
        writing the paged blocks in place (`paged_step`), where numba runs; else decode rows as
        this backend's decode step and prompt chunks on the model's forward
        (`torch_step.forward_rows`)."""
        if self.row_layers is None:
            return forward_rows(self, model, batch)
        return paged_step.run(self, batch)

    def decode(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, vocab) float32 logits of one decode step of input_ids (B, 1) on `cache` (see
        `DecodeBackend.decode`)."""
        self.check_step_ids(input_ids)
        token_ids = input_ids.cpu().numpy()[:, 0]  # (B,)
        listed = token_ids.tolist()  # (a few ints: cheaper than two numpy reductions)
        vocab = self.vocab
        if min(listed) < 0 or max(listed) >= vocab:
            raise IndexError(
                f"token ids must lie in [0, {vocab}), got min {min(listed)} and max {max(listed)}"
            )
        # (no autograd to switch off: every tensor the step makes comes from numpy or a detached
        # copy, so nothing it computes records a graph)
        if self._decodes_on_blocks(cache, len(listed), attention_mask):
            return self._decode_on_blocks(listed, cache)
        past = cache.get_seq_length()
        with torch_threads(self._threads(len(listed))):
            windows = self.config.layer_windows
            plan = cache.begin(1, attention_mask, device=torch.device("cpu"), windows=windows)
            try:
                return torch.from_numpy(self._run(token_ids, plan, cache))
            except BaseException:  # Ctrl-C between layers: undo the step (as the torch forward does)
                cache.abandon_forward(past)
                raise

    def _decodes_on_blocks(self, cache, rows: int, attention_mask) -> bool:
        """Whether a decode step of `rows` rows on `cache` runs as the engine's step: a PagedCache
        whose blocks exist, one row per token, no padding, the kernels' row layers built."""
        return (
            isinstance(cache, PagedCache) and attention_mask is None and self.row_layers is not None
            and len(cache.rows) == rows and bool(cache.layers) and cache.layers[0].allocated
        )

    def _decode_on_blocks(self, token_ids: list[int], cache) -> torch.Tensor:
        """A decode step on a PagedCache (rows without padding) as the engine runs one: every row's
        next token in one `PagedBatch`, the kernels reading the blocks in place (`paged_step`),
        instead of the seam's gather of every layer's whole context (and, for rows in a kv_dtype,
        its conversion each way)."""
        rows = list(range(len(token_ids)))
        batch = PagedBatch(cache, rows, [[token] for token in token_ids], [True] * len(rows))
        cache.reserve(rows, batch.totals)
        logits = paged_step.run(self, batch)
        cache.commit(rows, batch.totals)
        return logits

    def _run(self, token_ids: np.ndarray, plan, cache) -> np.ndarray:
        batch = len(token_ids)
        if self._numba_step(batch):
            return self._run_one_row(token_ids, plan, cache)
        heads, kv_heads, head_dim, group = self.heads, self.kv_heads, self.head_dim, self.group
        rotated = heads + kv_heads
        start = plan.start  # one int position for every row, or each row's own
        positions = start if isinstance(start, int) else plan.positions.numpy()[:, 0]
        cos, signed_sin = self.rope_rows(np.atleast_1d(positions))  # (B or 1, D) each
        cos, signed_sin = cos[:, None], signed_sin[:, None]  # (B or 1, 1, D): every head's
        visible_by_mask: dict[int, torch.Tensor | None] = {}
        layers, lm_head, linear = self.products(batch)
        x = self.embed_rows(token_ids)  # (B, hidden)
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate is inf: silu -> -0
            for index, w in enumerate(layers):
                qkv = linear(rms_norm(x, w.norm1, self.eps), w.qkv, w.qkv_bias)
                qkv = qkv.reshape(batch, rotated + kv_heads, head_dim)  # (B, H + 2·H_kv, D)
                if w.q_norm is not None:  # qwen3: each head's q and k normalised before RoPE
                    for lo, hi, weight in ((0, heads, w.q_norm), (heads, rotated, w.k_norm)):
                        rows = qkv[:, lo:hi].reshape(-1, head_dim)
                        qkv[:, lo:hi] = rms_norm(rows, weight, self.eps).reshape(batch, hi - lo, head_dim)
                turned = rotate(qkv[:, :rotated], cos, signed_sin)  # (B, H + H_kv, D): queries, keys
                q = turned[:, :heads]  # (B, H, D)
                q *= self.scale  # the 1/sqrt(D) of attention, on the queries (fewer than scores)
                k = turned[:, heads:].reshape(batch, kv_heads, 1, head_dim)
                v = qkv[:, rotated:].reshape(batch, kv_heads, 1, head_dim)
                keys, values = self._store(cache, k, v, index)  # (B, H_kv, T_kv, D)
                # each kv head with its group of queries: (B, H_kv, G, D) over (B, H_kv, T_kv, D)
                # (one call, no score copies; torch's grouped-query flag is slower on CPU)
                queries = torch.from_numpy(q.reshape(batch, kv_heads, group, head_dim))
                if keys.dtype != torch.float32:  # (a no-op .to costs as much as a small op)
                    queries = queries.to(keys.dtype)
                attended = F.scaled_dot_product_attention(
                    queries, keys, values,
                    attn_mask=self._visible(plan.mask(index), visible_by_mask),
                    scale=1.0,  # the queries carry 1/sqrt(D) already
                )  # (B, H_kv, G, D)
                if attended.dtype != torch.float32:
                    attended = attended.float()
                x += linear(attended.numpy().reshape(batch, heads * head_dim), w.o, w.o_bias)
                gate_up = linear(rms_norm(x, w.norm2, self.eps), w.gate_up, w.gate_up_bias)
                x += linear(swiglu(gate_up), w.down, w.down_bias)
        return linear(rms_norm(x, self.final_norm, self.eps), lm_head, None)  # (B, vocab)

    def _run_one_row(self, token_ids: np.ndarray, plan, cache) -> np.ndarray:
        """(1, vocab) logits of one row's step on numba's kernels: per layer `attention_inputs`
        (norm, q/k/v, q/k norms, RoPE, the queries' scale), the cache's update, `layer_output`
        (attention, o, residual, norm, SwiGLU, residual); then the final norm and lm_head."""
        kernels = numba_products.kernels()
        heads, kv_heads, dim, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        start = plan.start
        position = start if isinstance(start, int) else int(plan.positions[0, 0])
        cos, signed_sin = self.rope_rows(np.array([position]))  # (1, D) each
        layers, (head_parts, head_bias), rounding = self.row_layers
        visible_by_mask: dict[int, np.ndarray] = {}  # a layer mask's (T_kv,) numpy form, by its id
        x = self.embed_rows(token_ids)  # (1, hidden), updated in place layer by layer
        queries, keys_end = heads * dim, (heads + kv_heads) * dim
        for index, w in enumerate(layers):
            qkv = np.empty((1, keys_end + kv_heads * dim), np.float32)  # (new: the cache may keep k, v)
            kernels.attention_inputs(
                x, w.norm1, eps, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, signed_sin,
                self.scale, heads, kv_heads, rounding, qkv,
            )
            k = qkv[0, queries:keys_end].reshape(1, kv_heads, 1, dim)
            v = qkv[0, keys_end:].reshape(1, kv_heads, 1, dim)
            keys, values = self._store_rows(cache, k, v, index)  # (1, H_kv, T_kv, D)
            key_rows, key_step = numba_products.stored_rows(keys)
            value_rows, value_step = numba_products.stored_rows(values)
            table, layout = numba_products.buffer_layout(keys.shape[2], key_step, value_step)
            given = plan.mask(index)
            visible = visible_by_mask.get(id(given))
            if visible is None:  # (layers that share a mask object check and convert it once)
                mask = self._visible(given, {})
                visible = _ALL_VISIBLE if mask is None else mask.reshape(-1).numpy()
                visible_by_mask[id(given)] = visible
            kernels.layer_output(
                x, qkv, heads, kv_heads, key_rows, value_rows, *table, layout, visible,
                numba_products.key_rounding(keys), numba_products.NO_RECENT,
                w.o, w.o_bias, w.norm2, eps, w.gate_up, w.gate_up_bias, w.down, w.down_bias, rounding,
            )
        logits = np.empty((1, numba_products.outputs(head_parts)), np.float32)
        kernels.normed_product(x, self.final_norm, eps, head_parts, head_bias, rounding, logits)
        return logits

    def rope_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, signed_sin), each (N, D) float32, of positions (N,): the model's RotaryEmbedding
        table, which every CPU step turns its queries and keys by (`rows.rotate`, the kernels'
        `turned`)."""
        needed = int(positions.max()) + 1
        if needed > len(self._cos):
            self._extend_rope_table(needed)
        return self._cos[positions], self._signed_sin[positions]

    @staticmethod
    def _visible(
        mask: torch.Tensor | None, seen: dict[int, torch.Tensor | None]
    ) -> torch.Tensor | None:
        """A layer's boolean mask (B or 1, 1, 1, T_kv), None when absent or all True (layers
        that share a mask object check it once)."""
        if mask is None:
            return None
        key = id(mask)
        if key not in seen:
            if mask.dtype != torch.bool:
                raise BackendError(
                    f"the decode step reads boolean masks (True = may attend), got {mask.dtype}"
                )
            seen[key] = None if bool(mask.all()) else mask
        return seen[key]
