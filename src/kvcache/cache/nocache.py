"""NoCache: the cache that keeps nothing, so the model has one code path with or without one.

`update` returns k, v unchanged and masks are causal over the new tokens (+ padding); built
from a config with sliding layers, those layers' masks are also windowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Cache, LayerMasks
from .checks import check_crop, check_kv_pair, check_new_tokens
from .config import read_cache_geometry
from .errors import CacheShapeError, LayerIndexError
from .masks import build_mask, narrower_window


class NoCache(Cache):
    """Keeps nothing: every forward sees only its own tokens (use_cache=False).

    Args:
        config: optional model config (as for `make_cache`); its sliding-attention layers get
            causal ∩ window masks, the others plain causal.
        num_layers, window: explicit sizes, merged with the config.
        device: where masks are built when no attention_mask is given (default CPU).
    """

    def __init__(
        self,
        *,
        config: object = None,
        num_layers: int | None = None,
        window: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(device=device)
        geometry = read_cache_geometry(config, num_layers=num_layers, window=window)
        kinds = geometry.layer_kinds
        self._windows = None if kinds is None else [
            geometry.window if kind == "sliding" else None for kind in kinds
        ]
        self._default_window = geometry.window if geometry.default_kind == "sliding" else None

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return k, v (B, H_kv, T_new, D) unchanged after checking them."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise LayerIndexError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        check_kv_pair(k, v, layer_idx)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Always 0: nothing is kept."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise LayerIndexError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        return 0

    def attention_masks(
        self,
        new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> list[torch.Tensor]:
        """Causal masks (B or 1, 1, T_new, T_new) over the new tokens (∩ window on sliding
        layers: the config's, or the model's `windows`, the narrower where both give one);
        without either every layer index gets the same mask.

        attention_mask, if given, is (B, T_new) with 1 = real token, 0 = padding.
        """
        check_new_tokens(new_tokens)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] != new_tokens:
                raise CacheShapeError(
                    f"attention_mask must be (batch, new_tokens) = (batch, {new_tokens}) for a "
                    f"cache that keeps nothing, got shape {tuple(attention_mask.shape)}"
                )
            where = attention_mask.device
        else:
            where = torch.device(device) if device is not None else self._device
        positions = torch.arange(new_tokens, device=where or torch.device("cpu"))  # (T_new,)
        shared: dict[int | None, torch.Tensor] = {}

        def mask_for(window: int | None) -> torch.Tensor:
            if window not in shared:
                shared[window] = build_mask(
                    positions, positions, window=window, attention_mask=attention_mask
                )
            return shared[window]

        if windows is not None:
            own = self._windows or [self._default_window] * len(windows)
            return LayerMasks([mask_for(narrower_window(w, o)) for w, o in zip(windows, own)])
        if self._windows is None:
            return LayerMasks([], default=mask_for(self._default_window))
        return LayerMasks([mask_for(window) for window in self._windows])

    def crop(self, max_length: int) -> None:
        """Nothing to crop (a negative length still raises)."""
        check_crop(max_length)

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Nothing to select."""

    def reorder(self, beam_idx: torch.Tensor | Sequence[int]) -> None:
        """Nothing to reorder."""

    def repeat_interleave(self, repeats: int) -> None:
        """Nothing to repeat."""

    def reset(self) -> None:
        """Nothing to forget."""
