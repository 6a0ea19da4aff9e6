"""What one forward needs from the cache: the new tokens' positions and each layer's mask
(`ForwardPlan`, from `Cache.begin`), the masks as a list that may cover layers not created yet
(`LayerMasks`), and `CAUSAL`, the mask of a prompt that starts an empty cache."""

from __future__ import annotations

import torch


class _Causal:
    """A layer's mask when its keys are exactly the new tokens, in order, each query seeing
    itself and the keys before it (a prompt into an empty cache, no padding, no window it
    reaches): attention takes `is_causal=True` for it, which skips the masked half of the scores
    that an explicit mask would compute. `tensor(T)` is the same mask as a (1, 1, T, T) bool."""

    def tensor(self, tokens: int, device=None) -> torch.Tensor:
        return torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = _Causal()


def mark_causal(masks: LayerMasks, tokens: int) -> LayerMasks:
    """`masks` with each (1, 1, T, T) mask that is exactly the causal one replaced by CAUSAL
    (each distinct mask object compared once)."""
    shape = (1, 1, tokens, tokens)
    square = {id(m): m for m in (*masks, masks.default) if m is not None and m.shape == shape}
    if not square:
        return masks
    causal = CAUSAL.tensor(tokens, next(iter(square.values())).device)
    plain = {key for key, mask in square.items() if torch.equal(mask, causal)}

    def marked(mask):
        return CAUSAL if mask is not None and id(mask) in plain else mask

    return LayerMasks([marked(mask) for mask in masks], marked(masks.default))


class LayerMasks(list):
    """The per-layer masks of one forward: a list, one mask per known layer.

    For a cache that creates its layers on first use (layer count unknown), an index past the
    known layers returns `default`, the mask of a layer that is still empty.
    """

    def __init__(self, masks: list[torch.Tensor], default: torch.Tensor | None = None) -> None:
        super().__init__(masks)
        self.default = default

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, int) and index >= len(self) and self.default is not None:
            return self.default
        return super().__getitem__(index)


class ForwardPlan:
    """What one forward of T_new new tokens needs from the cache (`Cache.begin`).

    positions: (B or 1, T_new) long, the absolute position of each new token (for RoPE; a
        padding query gets 0). Built on first use when every row starts at `start`.
    start: where every row's first new token sits (a Python int, or a 0-d tensor for a compiled
        layer), or None when rows differ (padding, a paged cache's rows).
    masks: one boolean mask per layer, (B or 1, 1, T_new, T_kv_i), True = may attend, or
        `CAUSAL`; None when every key each layer's `update` returns is visible to every new token
        (attend unmasked).
    """

    __slots__ = ("masks", "start", "_positions", "_new_tokens", "_device")

    def __init__(
        self,
        masks: LayerMasks | None,
        *,
        positions: torch.Tensor | None = None,
        start: int | torch.Tensor | None = None,
        new_tokens: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if (positions is None) == (start is None):
            raise ValueError("a ForwardPlan needs either positions or a start")
        self.masks = masks
        self.start = start
        self._positions = positions
        self._new_tokens = new_tokens
        self._device = device

    @property
    def positions(self) -> torch.Tensor:
        """(B or 1, T_new) long absolute positions of the new tokens."""
        if self._positions is None:
            assert self.start is not None
            device = self.start.device if isinstance(self.start, torch.Tensor) else self._device
            self._positions = (self.start + torch.arange(self._new_tokens, device=device))[None]  # (1, T_new)
        return self._positions

    def mask(self, layer_idx: int) -> torch.Tensor | _Causal | None:
        """Layer `layer_idx`'s mask, `CAUSAL`, or None (every key visible)."""
        return None if self.masks is None else self.masks[layer_idx]

    def __repr__(self) -> str:
        where = f"start={self.start}" if self._positions is None else f"positions={self._positions.tolist()}"
        return f"ForwardPlan({where}, masks={'none' if self.masks is None else len(self.masks)})"
