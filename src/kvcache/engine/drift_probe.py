"""The live drift probe of a KV pool in a dtype of its own, quantized say (`Engine(kv_dtype=...,
kv_drift_sample=p)`): below, "quantized" is that pool, whatever its kv_dtype.

A share p of the requests, drawn as each is first admitted, also runs on a full-precision shadow
pool: each step that runs such a request's tokens on the quantized pool runs the same tokens on
its shadow row (a second, small batch on the same backend), so at every position the request
samples, the next-token distribution over its exact keys and values is there beside the one over
its quantized blocks, for the same history. Each position adds KL(p_exact || p_quantized) and
whether the two argmaxes agree to the request's `KVDrift` (the `kv_drift` beside its usage) and
to the engine's counts. A request the shadow pool has no room for (its prompt and max_tokens) is
not probed; one preempted stops being probed (what it measured so far is kept). The probe costs
a probed request's tokens once more and the shadow's bytes; the others run as they would.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field

import torch

from kvcache.cache import PagedBatch, PagedCache
from kvcache.engine.observers import StepObserver
from kvcache.engine.request import Request
from kvcache.engine.scheduler import blocks_for


@dataclass
class KVDrift:
    """How far one request's quantized pool moved its next-token distributions: at each probed
    position, KL(p_exact || p_quantized) (nats) and whether the greedy tokens agree."""

    kl: list[float] = field(default_factory=list)  # one per position
    agreements: int = 0

    @property
    def positions(self) -> int:
        return len(self.kl)

    def as_dict(self) -> dict:
        """The request's `kv_drift` object: positions probed, mean and max KL, top-1 agreement."""
        count = len(self.kl)
        if not count:
            return {"positions": 0, "mean_kl": None, "max_kl": None, "top1_agreement": None}
        return {"positions": count, "mean_kl": sum(self.kl) / count, "max_kl": max(self.kl),
                "top1_agreement": self.agreements / count}


class DriftProbe(StepObserver):
    """The shadow pool and the probed requests (in its rows' order); see the module docstring.

    sample: the share of requests probed, 0 < sample <= 1; shadow_blocks: the shadow pool's
    blocks of `block_size` tokens, full precision (the model's dtype); seed: of the draws."""

    def __init__(self, model, backend, sample: float, shadow_blocks: int, block_size: int,
                 seed: int | None = None) -> None:
        if not 0 < sample <= 1:
            raise ValueError(f"kv_drift_sample must be in (0, 1], got {sample!r}")
        self.model, self.backend, self.sample = model, backend, sample
        self.shadow = PagedCache(shadow_blocks, block_size, config=model.config, dtype=model.dtype,
                                 device=model.device)
        self.probed: list[Request] = []  # row r of the shadow is probed[r]'s
        self.random = random.Random(seed)
        self.positions = 0  # probed positions since start, and of those, greedy agreements
        self.agreements = 0
        self.seconds = 0.0  # spent in the shadow's steps since start: what the probe costs

    def stats(self) -> dict:
        """Positions probed since start and the share whose greedy tokens agreed."""
        return {"sample": self.sample, "probing": len(self.probed), "positions": self.positions,
                "top1_agreement": self.agreements / self.positions if self.positions else None,
                "seconds": self.seconds}

    @contextlib.contextmanager
    def warming(self):
        """Probe every request admitted meanwhile (the engine's warm-up, so the shadow's road runs
        too); the counters start again after."""
        sample, self.sample = self.sample, 1.0
        try:
            yield
        finally:
            self.sample, self.positions, self.agreements, self.seconds = sample, 0, 0, 0.0

    def admitted(self, requests: list[Request]) -> None:
        """Draw whether each request admitted for the first time is probed, and give a drawn one a
        shadow row when the shadow has room for its prompt and max_tokens."""
        allocator = self.shadow.allocator
        for request in requests:
            if request.drift is not None or not request.first_pass or self.random.random() >= self.sample:
                continue
            needed = blocks_for(len(request.prompt) + request.params.max_tokens, self.shadow.block_size)
            if needed <= allocator.num_allocatable - self._reserved():
                request.drift = KVDrift()
                self.shadow.add_sequence()  # (holds nothing: its first step runs every token so far)
                self.probed.append(request)

    def _reserved(self) -> int:
        """Blocks the probed requests may still take to reach their prompt and max_tokens."""
        size = self.shadow.block_size
        return sum(blocks_for(len(r.prompt) + r.params.max_tokens, size)
                   - len(self.shadow.allocator.sequence(seq).table)
                   for r, seq in zip(self.probed, self.shadow.rows))

    def released(self, requests: list[Request]) -> None:
        """Free the shadow rows of these requests (finished, or preempted: no longer probed)."""
        gone = {request.id for request in requests}
        keep = [row for row, request in enumerate(self.probed) if request.id not in gone]
        if len(keep) < len(self.probed):
            self.shadow.select(keep)
            self.probed = [self.probed[row] for row in keep]

    def forwarded(self, work, logits: torch.Tensor) -> None:
        """After a step of the quantized pool (`work`: its batch and its rows' requests; the
        sampling rows' `logits` (S, vocab)): run the probed requests' same tokens on their shadow rows (each
        from what its shadow row holds to where its real row now ends) and add each sampled
        position's drift."""
        batch, requests = work.batch, work.requests
        rows = {request.id: row for row, request in enumerate(self.probed)}
        position_of = {index: position for position, index in enumerate(batch.sampled)}
        shadow_rows, tokens, sample, compared = [], [], [], []
        for index, (request, total) in enumerate(zip(requests, batch.totals)):
            row = rows.get(request.id)
            if row is None:
                continue
            shadow_rows.append(row)
            tokens.append(request.tokens[self.shadow.row_lengths[row] : total])
            sample.append(index in position_of)
            if index in position_of:
                compared.append((request, position_of[index]))
        if not shadow_rows:
            return
        started = time.perf_counter()
        exact = self._step(shadow_rows, tokens, sample)  # (the sampled shadow rows, in order, vocab)
        self._record([request for request, _ in compared], exact, logits[[at for _, at in compared]])
        self.seconds += time.perf_counter() - started

    def _step(self, rows: list[int], tokens: list[list[int]], sample: list[bool]) -> torch.Tensor:
        """One step of the shadow pool: its rows' blocks reserved, the backend's step, committed."""
        batch = PagedBatch(self.shadow, rows, tokens, sample)
        self.shadow.reserve(rows, batch.totals)
        with torch.inference_mode():
            logits = self.backend.step(self.model, batch)
        self.shadow.commit(rows, batch.totals)
        return logits

    def _record(self, requests: list[Request], exact: torch.Tensor, quantized: torch.Tensor) -> None:
        """Add KL(p_exact || p_quantized) and top-1 agreement of each request's position."""
        exact_log, quantized_log = exact.float().log_softmax(-1), quantized.float().log_softmax(-1)
        kl = (exact_log.exp() * (exact_log - quantized_log)).sum(-1).clamp_min(0)  # (rounding: >= 0)
        agree = exact_log.argmax(-1) == quantized_log.argmax(-1)
        for request, value, same in zip(requests, kl.tolist(), agree.tolist()):
            request.drift.kl.append(value)
            request.drift.agreements += same
            self.positions += 1
            self.agreements += same
