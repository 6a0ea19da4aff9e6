"""The seam between model and cache: `Cache`, an ordered list of `CacheLayer`s.

The model calls `begin(new_tokens, attention_mask)` once per forward (the new tokens' positions
and each layer's mask, or no masks when every key is visible), then `update(k, v, layer_idx)`
once per layer; a layer's length moves only inside those.
Every layer kind answers the same questions (its length, the absolute positions of the rows it
will return), so the model never branches on the kind of cache.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from .checks import (
    check_attention_mask,
    check_batch_index,
    check_crop,
    check_new_tokens,
)
from .errors import CacheError, CacheShapeError, CacheStateError, LayerIndexError
from .layer import CacheLayer, is_compiling
from .masks import build_mask, narrower_window
from .plan import ForwardPlan, LayerMasks, mark_causal

__all__ = ["Cache", "CacheLayer", "ForwardPlan", "LayerMasks", "is_compiling"]

# what transformers asks of a cache and kvcache's Cache does not answer (kvcache.hf does)
_TRANSFORMERS_PROTOCOL = frozenset({
    "is_compileable", "get_query_offset", "get_mask_sizes", "is_sliding", "is_linear", "is_dummy",
    "is_initialized", "is_croppable", "layer_class_to_replicate", "early_initialization",
    "batch_select_indices", "batch_repeat_interleave", "reorder_cache", "offloading",
    "activate_past_recording", "get_max_length", "_is_user_defined",
})
_SAME_NAMES = {"DynamicCache", "StaticCache", "SlidingWindowCache", "QuantizedCache", "PagedCache"}


class Cache:
    """An ordered list of `CacheLayer`s: `cache.layers[i]` holds layer i's keys and values.

    Args:
        layers: the layers, one per attention layer of the model.
        layer_factory: if given, layers are created on first use by `update(k, v, i)` with
            i == len(layers), so the layer count need not be known in advance.
        device: where masks are built while the cache is empty and no attention_mask is given.
    """

    def __init__(
        self,
        layers: Sequence[CacheLayer] = (),
        *,
        layer_factory: Callable[[], CacheLayer] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.layers: list[CacheLayer] = []
        self._layer_factory = layer_factory
        self._device = None if device is None else torch.device(device)
        for layer in layers:
            self._append(layer)

    def _append(self, layer: CacheLayer) -> CacheLayer:
        layer.layer_idx = len(self.layers)
        self.layers.append(layer)
        return layer

    def _layer(self, layer_idx: int, *, create: bool) -> CacheLayer | None:
        count = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise LayerIndexError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if 0 <= layer_idx < count:
            return self.layers[layer_idx]
        if self._layer_factory is not None and layer_idx >= count:
            if not create:
                return None
            if layer_idx == count:
                return self._append(self._layer_factory())
            raise LayerIndexError(
                f"layer_idx {layer_idx} skips layers: this cache creates layers in order and "
                f"holds {count}, so the next new layer index is {count}"
            )
        raise LayerIndexError(
            f"layer_idx must be in [0, {count}) for this cache of {count} layers, "
            f"got {layer_idx}"
        )

    # ---- the seam -------------------------------------------------------------------------
    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D) for `layer_idx`; return K, V (B, H_kv, T_visible, D)."""
        layer = self._layer(layer_idx, create=True)
        assert layer is not None
        return layer.update(k, v)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far by layer `layer_idx` (0 for a layer not created yet)."""
        layer = self._layer(layer_idx, create=False)
        return 0 if layer is None else layer.get_seq_length()

    def positions(
        self, new_tokens: int, layer_idx: int = 0, *, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Absolute positions past .. past + new_tokens - 1 of the next chunk, (T_new,) long.

        The same as torch.arange(past, past + new_tokens), but a compiled layer derives it from
        its length tensor (`CacheLayer.start_position`), so a compiled step that needs the
        positions (e.g. for RoPE without padding) does not specialise on the length the way
        reading get_seq_length() (a Python int) would.
        """
        check_new_tokens(new_tokens)
        start = self._start(layer_idx)
        where = start.device if isinstance(start, torch.Tensor) else (device or self._device)
        return start + torch.arange(new_tokens, device=where)

    def _start(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Where layer `layer_idx`'s next token sits (0 for a layer not created yet, or a cache
        that holds no layers: it starts at 0)."""
        layer = None if not self.layers and layer_idx == 0 else self._layer(layer_idx, create=False)
        return 0 if layer is None else layer.start_position()

    def attention_masks(
        self,
        new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> list[torch.Tensor]:
        """One boolean mask per layer for the next forward of `new_tokens` tokens.

        Call before that forward's `update` calls. Mask i has shape (B or 1, 1, new_tokens,
        T_kv_i), True = may attend, where T_kv_i is the length of K that `update` returns on
        layer i; query j sits at absolute position past + j, past = get_seq_length(i).

        Args:
            new_tokens: tokens in this forward's chunk (>= 1).
            attention_mask: optional (B, past + new_tokens), 1 = real token, 0 = padding.
            device: where to build masks while the cache is empty and no attention_mask is
                given (default: the cache's `device`, else CPU).
            windows: the model's sliding window of each layer (None: full attention), applied
                whatever the cache keeps (see `begin`).
        """
        check_new_tokens(new_tokens)
        fallback = _fallback_device(attention_mask, device, self._device)
        shared: dict[Hashable, torch.Tensor] = {}
        masks = [
            self._mask_for(layer, new_tokens, attention_mask, fallback, shared, _window_of(layer, windows, i))
            for i, layer in enumerate(self.layers)
        ]
        default = None
        if self._layer_factory is not None:
            # layers not created yet: like the last one (they all see the same tokens), or
            # like a fresh layer before the first update; each within the model's window
            fresh = self._layer_factory()
            for i in range(len(masks), len(windows or ())):
                window = _window_of(fresh, windows, i)
                masks.append(self._mask_for(fresh, new_tokens, attention_mask, fallback, shared, window))
            default = masks[-1] if masks else self._mask_for(
                fresh, new_tokens, attention_mask, fallback, shared, fresh.window
            )
        return LayerMasks(masks, default)

    def begin(
        self,
        new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> ForwardPlan:
        """What the next forward of `new_tokens` tokens needs: their positions and each layer's
        mask (`ForwardPlan`). Call once per forward, before its `update` calls.

        attention_mask: optional (B, past + new_tokens), 1 = real token, 0 = padding; the new
        tokens' positions count only the real tokens before them. Without it every row's new
        tokens sit at past, past + 1, …, and when every layer says that all the keys its update
        returns are visible (`CacheLayer.sees_every_key`: one new token, nothing windowed away)
        the plan has no masks.

        windows: the model's sliding window of each layer (None: full attention). The window is
        the model's property: a query at q sees keys in (q - w, q] however many the cache keeps
        (a cache built without the model's config keeps every key), and a layer that keeps a
        ring of its own is masked by the narrower of the two.
        """
        check_new_tokens(new_tokens)
        if not is_compiling():
            self.check_lengths_agree()
        if attention_mask is not None:
            past = self.get_seq_length()
            counted = attention_mask.long().cumsum(-1) - 1  # (B, past + T_new)
            positions = counted[:, past:].clamp(min=0)  # (B, T_new)
            masks = self.attention_masks(new_tokens, attention_mask, device=device, windows=windows)
            return ForwardPlan(masks, positions=positions)
        where = dict(start=self._start(), new_tokens=new_tokens, device=device or self._device)
        layers = self.layers or ([self._layer_factory()] if self._layer_factory is not None else [])
        own_windows = all(_window_of(layer, windows, i) == layer.window for i, layer in enumerate(layers))
        if windows is not None and len(windows) > len(layers):
            own_windows = False  # layers still to be created, each with the model's window
        if layers and own_windows and all(layer.sees_every_key(new_tokens) for layer in layers):
            return ForwardPlan(None, **where)
        masks = self.attention_masks(new_tokens, device=device, windows=windows)
        if new_tokens > 1 and isinstance(where["start"], int) and where["start"] == 0:
            masks = mark_causal(masks, new_tokens)  # a prompt into an empty cache: is_causal
        return ForwardPlan(masks, **where)

    @staticmethod
    def _mask_for(
        layer: CacheLayer,
        new_tokens: int,
        attention_mask: torch.Tensor | None,
        fallback: torch.device,
        shared: dict[Hashable, torch.Tensor],
        window: int | None,
    ) -> torch.Tensor:
        key = (layer.mask_key(new_tokens), window)
        mask = shared.get(key)
        if mask is None:
            if attention_mask is not None and not is_compiling():
                check_attention_mask(attention_mask, layer, new_tokens)
            device = layer.device or fallback
            query_positions, key_positions = layer.mask_positions(new_tokens, device)
            if attention_mask is not None:
                attention_mask = attention_mask.to(device)
            mask = build_mask(
                query_positions,
                key_positions,
                window=window,
                attention_mask=attention_mask,
            )
            shared[key] = mask
        return mask

    def check_lengths_agree(self) -> None:
        """Raise `CacheStateError` unless every layer holds the same number of tokens (a forward
        that failed between layers and could not be undone leaves them apart)."""
        lengths = [layer.get_seq_length() for layer in self.layers]
        if lengths and min(lengths) != max(lengths):
            raise CacheStateError(
                f"the cache's layers hold different lengths {lengths}: a forward was interrupted "
                f"between layers; crop({min(lengths)}) to go back to where every layer agrees, or reset()"
            )

    def abandon_forward(self, length: int) -> None:
        """After a forward failed between layers (an exception, Ctrl-C): put every layer back to
        `length` tokens, the length before it, where it can be. A layer that cannot go back (a
        ring that already overwrote rows) stays ahead, and `begin` refuses the cache (named
        error) until `reset`."""
        try:
            self.crop(length)
        except CacheError:
            pass

    # ---- whole-cache operations -------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens of every layer (speculative-decoding rollback)."""
        check_crop(max_length)
        for layer in self.layers:  # all or nothing: check every layer before changing one
            layer.validate_crop(max_length)
        for layer in self.layers:
            layer.crop(max_length)

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep batch rows `indices` (1-D, in that order) in every layer."""
        for layer in self.layers:  # all or nothing
            if layer.batch_size is not None and layer.device is not None:
                check_batch_index(indices, layer.batch_size, layer.device)
        for layer in self.layers:
            layer.select(indices)

    def reorder(self, beam_idx: torch.Tensor | Sequence[int]) -> None:
        """Reorder the batch by `beam_idx` (1-D, same length as the batch), as beam search does."""
        for layer in self.layers:
            batch = layer.batch_size
            if batch is not None and len(beam_idx) != batch:
                raise CacheShapeError(
                    f"beam_idx must have one entry per batch row ({batch}), got {len(beam_idx)}; "
                    f"use select() to change the batch size"
                )
        self.select(beam_idx)

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times (B → B × repeats) in every layer."""
        for layer in self.layers:
            layer.repeat_interleave(repeats)

    def reset(self) -> None:
        """Forget every token in every layer; storage is kept for reuse."""
        for layer in self.layers:
            layer.reset()

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values over all layers."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def nbytes_used(self) -> int:
        """Bytes of the rows holding live tokens over all layers."""
        return sum(layer.nbytes_used for layer in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getattr__(self, name: str):
        """Only for attributes this cache lacks: transformers' cache protocol gets a pointer to
        the adapter, anything else the usual AttributeError."""
        if name in _TRANSFORMERS_PROTOCOL:
            kind = type(self).__name__
            also = f", or build it with kvcache.hf.{kind}" if kind in _SAME_NAMES else ""
            raise AttributeError(
                f"{kind} is a kvcache cache, which a transformers model does not take as it is "
                f"({name!r} is transformers' cache protocol): pass kvcache.hf.to_transformers(cache){also}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        kinds = ", ".join(type(layer).__name__ for layer in self.layers[:4])
        more = ", …" if len(self.layers) > 4 else ""
        return (
            f"{type(self).__name__}({len(self.layers)} layers [{kinds}{more}], "
            f"seq_length={self.get_seq_length() if self.layers else 0})"
        )


def _window_of(layer: CacheLayer, windows: Sequence[int | None] | None, index: int) -> int | None:
    """The window layer `index` attends within: the narrower of the model's and the layer's own."""
    model = windows[index] if windows is not None and index < len(windows) else None
    return narrower_window(model, layer.window)


def _fallback_device(
    attention_mask: torch.Tensor | None,
    device: torch.device | str | None,
    cache_device: torch.device | None,
) -> torch.device:
    if attention_mask is not None:
        return attention_mask.device
    if device is not None:
        return torch.device(device)
    return cache_device or torch.device("cpu")
