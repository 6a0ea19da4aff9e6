"""A model's fingerprint: a digest of its config and of every byte of every weight, so that keys
and values saved or shared under it (prompt-cache files, a shared block store) are never read by
another checkpoint, even one that differs in a single value."""

from __future__ import annotations

import hashlib
import weakref

import torch

from kvcache.model.quantized import block_weights

_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its fingerprint


def model_fingerprint(model) -> str:
    """A 32-hex-digit blake2b digest of `model`'s config and of all its parameters (names,
    shapes, dtypes and bytes) and of the weights it keeps as GGUF blocks (names, kinds, shapes,
    how their products read activations, and bytes: a q8 run's keys and values are not a float
    run's). Hashing reads every weight once, so it is computed once per model object and
    remembered (weights changed in place afterwards are not seen)."""
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
    hashed = set()  # (a tied head shares the embedding's blocks: their bytes are read once)
    for name, weight in block_weights(model).items():  # a GGUF's kept blocks, and how they read x
        digest.update(f"{name}{weight.kind}{weight.rows}x{weight.columns}{weight.activations}".encode())
        if id(weight.blocks) not in hashed:
            hashed.add(id(weight.blocks))
            digest.update(weight.blocks.data if weight.blocks.flags.c_contiguous else weight.blocks.tobytes())
    _DIGESTS[model] = fingerprint = digest.hexdigest()
    return fingerprint
