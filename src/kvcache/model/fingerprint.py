"""A model's fingerprint: a digest of its config and of every byte of every weight, so that keys
and values saved or shared under it (prompt-cache files, a shared block store) are never read by
another checkpoint, even one that differs in a single value."""

from __future__ import annotations

import hashlib
import weakref

import torch

_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its fingerprint


def model_fingerprint(model) -> str:
    """A 32-hex-digit blake2b digest of `model`'s config and of all its parameters (names,
    shapes, dtypes and bytes). Hashing reads every weight once, so it is computed once per model
    object and remembered (weights changed in place afterwards are not seen)."""
    known = _DIGESTS.get(model)
    if known is not None:
        return known
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(sorted(vars(model.config).items())).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            data = param.detach().contiguous().cpu()
            digest.update(data.view(torch.uint8).numpy().data if data.numel() else b"")
    _DIGESTS[model] = fingerprint = digest.hexdigest()
    return fingerprint
