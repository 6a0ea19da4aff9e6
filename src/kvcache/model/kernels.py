"""Decoding kernels: fused projection weights, and the choice of decode step per machine.

A decode step reads every weight once for a handful of rows, so its speed is memory bandwidth.
Two things help on CPU (see PERF-NOTES): fewer, larger products (q/k/v as one matrix, gate/up
as one), and a matrix-vector kernel that streams weights fast. On the machines measured,
torch's CPU product (MKL) reads weights at ~17 GB/s and numpy's OpenBLAS `W @ x` faster (~57
GB/s in PERF-NOTES, ~20-29 GB/s with 2 threads on the machine of this session), so float32
CPU models can decode with the numpy step (`numpy_decode`); `choose_decode_path` times real
decode steps of each on this machine and keeps the fastest. Every other forward (prefill, the
no-cache path, big batches) is the torch module forward with the caller's thread count: mixing
OpenBLAS calls into it would leave OpenBLAS's spinning threads fighting torch's for the cores.

Fusing keeps the checkpoint's parameters: q_proj.weight, k_proj.weight and v_proj.weight
become views into one (q + k + v, hidden) tensor, so names, shapes and `state_dict()` are
unchanged and no weight is stored twice.
"""
from __future__ import annotations

import time

import torch
from torch import nn

BACKENDS = ("torch", "numpy")
# batch rows up to which a decode step (one new token per row) runs on the numpy step
MATVEC_ROWS = 8


def calls_more_than_forward(module: nn.Module) -> bool:
    """Whether calling `module` does more than its class's `forward`: a forward hook or pre-hook
    on it, or a `forward` set on the instance. (Global hooks: `global_forward_hooks`.)"""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def global_forward_hooks() -> bool:
    """Whether hooks that run on every module call are registered
    (`torch.nn.modules.module.register_module_forward_hook` and its pre-hook twin)."""
    registry = torch.nn.modules.module
    names = ("_global_forward_hooks", "_global_forward_pre_hooks")
    return any(getattr(registry, name, None) for name in names)


class FusedLinear:
    """Several nn.Linear of one input, as one weight whose slices are their parameters."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        with torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears], dim=0)  # (sum out, in)
            has_bias = [linear.bias is not None for linear in linears]
            if any(has_bias) and not all(has_bias):
                raise ValueError("cannot fuse linears where only some have a bias")
            self.bias = torch.cat([linear.bias for linear in linears]) if all(has_bias) else None
        self.sizes = [linear.out_features for linear in linears]
        self.linears = linears
        self._point_parameters(with_bias=True)

    def _point_parameters(self, *, with_bias: bool) -> None:
        """Make each linear's weight (and bias) a slice of the fused one."""
        start = 0
        for linear, size in zip(self.linears, self.sizes, strict=True):
            grad = linear.weight.requires_grad
            linear.weight = nn.Parameter(self.weight[start : start + size], requires_grad=grad)
            if with_bias and self.bias is not None:
                linear.bias = nn.Parameter(self.bias[start : start + size], requires_grad=grad)
            start += size

    def store_transposed(self) -> None:
        """Keep the fused weight as a contiguous (in, out) matrix; the (out, in) weight and the
        parameters become transposed views of it (same names, shapes and values)."""
        self.weight = column_major(self.weight)  # (sum out, in)
        self._point_parameters(with_bias=False)

    def is_intact(self) -> bool:
        """Whether every parameter is still a view of the fused weight (not replaced or cast)."""
        base = self.weight.untyped_storage().data_ptr()
        return all(linear.weight.untyped_storage().data_ptr() == base for linear in self.linears)

    def replaces_calls(self) -> bool:
        """Whether one product with the fused weight computes exactly what calling the linears
        would: each still a plain nn.Linear (no subclass, hook or instance `forward`), no global
        hooks, and every parameter a view of the fused weight."""
        return (
            all(type(linear) is nn.Linear and not calls_more_than_forward(linear) for linear in self.linears)
            and not global_forward_hooks()
            and self.is_intact()
        )


def fuse_projections(model) -> None:
    """Fuse q/k/v and gate/up of every layer of a LlamaForCausalLM, for decode speed: the numpy
    step reads the fused weights, and the torch forward uses them for decode rows (a prefill
    runs the separate projections, faster there: see llama._fused_applies)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.fused_qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.fused_gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj])


# out/in ratio from which a weight is stored column-major for the numpy step
TALL = 1.5


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a 2-D (out, in) weight with the same values and shape, stored column-major
    (a transposed view of a contiguous (in, out) tensor)."""
    with torch.no_grad():
        return weight.t().contiguous().t()


def store_tall_weights_transposed(model) -> None:
    """Store the tall weights (out >= TALL × in: q/k/v fused, gate/up fused, an untied lm_head)
    column-major.

    numpy's matrix-vector product then runs OpenBLAS's column-major kernel, which on the
    machine measured streams a tall float32 matrix from memory faster than the row-major one
    (gate/up 1.4-1.6×, q/k/v 1.1-1.3×; `benchmarks/probe_matvec_layout.py`); a wide one, like
    down_proj, reads ~0.77× as fast that way and stays row-major, as do square ones (o_proj:
    0.98-1.13×). Values, names and shapes are unchanged; the parameters become transposed
    (non-contiguous) views, so `state_dict()` tensors need `.contiguous()` before
    `safetensors.torch.save_file`.
    """
    # a numpy step built before (choose_decode_path) holds views of the row-major tensors: drop
    # it first, so each one is freed as soon as its column-major copy replaces it
    model.forget_numpy_step()
    for layer in model.model.layers:
        for fused in (layer.self_attn.fused_qkv, layer.mlp.fused_gate_up):
            if fused is None or not fused.is_intact():
                continue
            out_features, in_features = fused.weight.shape
            if out_features >= TALL * in_features:
                fused.store_transposed()
    head = model.lm_head
    if head.weight is not model.model.embed_tokens.weight and head.out_features >= TALL * head.in_features:
        head.weight = nn.Parameter(column_major(head.weight), requires_grad=head.weight.requires_grad)


def _median_seconds(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def numpy_available() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


class torch_threads:  # noqa: N801 (used as a function: `with torch_threads(1): ...`)
    """Run the block with `threads` torch CPU threads (None: leave as is), then restore.
    A class, not a generator-based context manager: it wraps every decode step."""

    __slots__ = ("threads", "before")

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self.before = 0

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc_info) -> None:
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.before)


def choose_decode_path(model, repeats: int = 5, context: int = 32) -> dict[tuple[str, int], float]:
    """Time real decode steps with each kernel and thread count; keep the fastest.

    Candidates: backend "torch" with torch threads 1 and the current count (one decode row is
    small work: waking a second thread can cost more than it saves, most of all on a busy
    machine), and for float32 CPU models "numpy" with one torch thread (its step is numpy
    calls whose matrix-vector products use OpenBLAS's own threads; an idle OpenMP pool spinning
    beside them would only take their core). Sets `model.matvec_backend` and
    `model.decode_threads`; returns seconds per decode step for each candidate.
    """
    from kvcache.cache import make_cache

    candidates = [("torch", threads) for threads in sorted({1, torch.get_num_threads()})]
    if model.dtype == torch.float32 and model.device.type == "cpu" and numpy_available():
        candidates.append(("numpy", 1))
    vocab = model.config.vocab_size
    prompt = torch.arange(context, device=model.device)[None] % vocab  # (1, context)
    token = prompt[:, -1:]  # (1, 1)
    timings: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for backend, threads in candidates:
            model.matvec_backend = backend
            cache = make_cache("dynamic", config=model.config)  # grows by a few tokens
            model(prompt, past_key_values=cache, logits_to_keep=1)

            def step(cache=cache):
                model(token, past_key_values=cache, logits_to_keep=1)

            with torch_threads(threads):
                timings[(backend, threads)] = _median_seconds(step, repeats)
    model.matvec_backend, model.decode_threads = min(timings, key=timings.get)
    return timings
