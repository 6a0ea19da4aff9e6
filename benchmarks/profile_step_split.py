"""A decode step split into its products, its attention and the rest, for each weight dtype.

    .venv/bin/python benchmarks/profile_step_split.py --model 100m --context 128
    .venv/bin/python benchmarks/profile_step_split.py --model smollm2 --context 2048
    .venv/bin/python benchmarks/profile_step_split.py --model smollm2 --activations q8

The step as `choose_backend` picks it (float32: the numpy step; bfloat16: the half step) is
timed in a loop on a dynamic cache of `--context` tokens (cropped back after each step); then
its products alone, on the step's own weights and threads, one row each. A step on numba's
kernels (`numba_products`) is then split by timing each kernel call and cache store from
outside: the kernels' time beyond the products alone (attention, norms, RoPE, SwiGLU), the
stores, and the Python between the calls (the step minus both), medians of 5 rounds of products
alone and steps in turn. Any other step: torch's
attention alone (on the step's torch threads) on keys and values of that length (the step's
call shape), and the rest is the step minus products and attention; attention alone reuses one
layer's keys, which stay in cache, where inside the step they come from memory, so the rest holds
that difference too. Medians (kernel and store times: means); stdout only; not a test.
"""

from __future__ import annotations

import argparse
import time

import kvcache  # noqa: F401 (imported before numpy and torch: it sets OpenBLAS's spin, as for its users)


def median_ms(function, runs: int = 40) -> float:
    for _ in range(5):
        function()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return sorted(times)[runs // 2] * 1000


def build(name: str, activations: str = "float32"):
    import torch

    from kvcache import load_model
    from kvcache.model import LlamaForCausalLM, ModelConfig

    if name == "smollm2":
        from bench_decode import smollm2_gguf

        return load_model(smollm2_gguf(), activations=activations)  # its weights kept as blocks
    config = ModelConfig.from_dict(dict(
        model_type="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=2048, vocab_size=32000, max_position_embeddings=8192))
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def products(backend):
    """A function running every product of one step as a one-row step runs them, and the bytes
    of weights they read: numba's kernels' product on the step's `row_layers` where the step
    runs on them, else the step's `products(1)` (its weights and its product function)."""
    import numpy as np
    import torch

    from kvcache.backends.cpu import numba_products

    config = backend.config
    dtype = getattr(backend, "dtype", torch.float32)
    width = torch.finfo(dtype).bits // 8
    sizes = {"hidden": config.hidden_size, "heads": config.num_attention_heads * config.head_dim,
             "inner": config.intermediate_size}
    ins = {"qkv": "hidden", "o": "heads", "gate_up": "hidden", "down": "inner"}
    if backend._numba_step(1):
        layers, (head, head_bias), _ = backend.row_layers
        calls = [(getattr(w, name), getattr(w, f"{name}_bias"), sizes[ins[name]])
                 for w in layers for name in ins]
        calls.append((head, head_bias, sizes["hidden"]))
        rows = [np.ones(columns, np.float32) for _, _, columns in calls]
        read = sum(part[0].nbytes if isinstance(part, tuple) else part.shape[0] * columns * width
                   for parts, _, columns in calls for part in parts)
        return (lambda: [numba_products.product(row, parts, bias, dtype)
                         for (parts, bias, _), row in zip(calls, rows)]), read
    outs = {"qkv": (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim,
            "o": config.hidden_size, "gate_up": 2 * config.intermediate_size, "down": config.hidden_size}
    layers, lm_head, linear = backend.products(1)
    calls = [(getattr(w, name), sizes[ins[name]], outs[name]) for w in layers for name in outs]
    calls.append((lm_head, sizes["hidden"], config.vocab_size))
    rows = [np.ones((1, width), np.float32) for _, width, _ in calls]
    read = sum(columns * out * width for _, columns, out in calls)
    return (lambda: [linear(row, weight, None) for (weight, _, _), row in zip(calls, rows)]), read


def kernel_times(backend, decode, steps: int = 10) -> tuple[float, float, float]:
    """(ms a step takes, ms of it inside numba's kernels, ms in its cache stores), means over
    `steps` steps, each kernel call and store timed from outside."""
    import types
    from unittest import mock

    from kvcache.backends.cpu import numba_products

    kernels = numba_products.kernels()
    spent = {"kernels": 0.0, "store": 0.0}

    def timed(function, key):
        def call(*args):
            started = time.perf_counter()
            result = function(*args)
            spent[key] += time.perf_counter() - started
            return result
        return call

    wrapped = types.SimpleNamespace(**vars(kernels))
    for name in ("attention_inputs", "layer_output", "normed_product"):
        setattr(wrapped, name, timed(getattr(kernels, name), "kernels"))
    with mock.patch.object(numba_products, "kernels", lambda: wrapped), \
            mock.patch.object(backend, "_store_rows", timed(backend._store_rows, "store")):
        started = time.perf_counter()
        for _ in range(steps):
            decode()
        total = time.perf_counter() - started
    return total / steps * 1000, spent["kernels"] / steps * 1000, spent["store"] / steps * 1000


def measure(model, dtype, context: int) -> str:
    """One line: the step of `model` cast to `dtype` at `context` tokens, split."""
    import torch
    import torch.nn.functional as F

    from kvcache.backends import choose_backend
    from kvcache.backends.cpu.threads import torch_threads
    from kvcache.cache import make_cache

    model = model.to(dtype)
    backend = choose_backend(model)
    config = model.config
    cache = make_cache("dynamic", config=config, dtype=dtype)
    with torch.inference_mode():
        model(torch.randint(0, config.vocab_size, (1, context)), past_key_values=cache)
        token = torch.tensor([[5]])

        def decode():
            backend.decode(token, cache)
            cache.crop(context)  # every step attends over `context` keys

        step = median_ms(decode)
        run_products, read = products(backend)
        with torch_threads(backend._threads(1)):  # the threads a one-row step runs on
            product_ms = median_ms(run_products)

        def described(ms: float) -> str:
            return f"products {ms:.2f} ms ({read / ms / 1e6:.1f} GB/s over {read / 1e6:.0f} MB)"

        split = described(product_ms)
        if backend._numba_step(1):  # rounds of products alone and timed steps in turn
            rounds = []
            for _ in range(5):
                with torch_threads(backend._threads(1)):
                    alone = median_ms(run_products, runs=8)
                rounds.append((alone, *kernel_times(backend, decode)))
            product_ms, step, in_kernels, store = (sorted(column)[2] for column in zip(*rounds))
            split = described(product_ms)
            return (f"{backend.name} step on numba's kernels, {str(dtype)[6:]}: {step:.2f} ms = {split} "
                    f"+ the kernels' other work (attention, norms, RoPE, SwiGLU) "
                    f"{in_kernels - product_ms:.2f} ms "
                    f"+ cache stores {store:.2f} ms + Python between {step - in_kernels - store:.2f} ms")
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        keys = torch.randn(1, kv_heads, context, dim).to(dtype)
        values = torch.randn_like(keys)
        queries = torch.randn(1, kv_heads, heads // kv_heads, dim).to(dtype)
        layers = config.num_hidden_layers
        with torch_threads(backend._threads(1)):
            attention = median_ms(
                lambda: [F.scaled_dot_product_attention(queries, keys, values) for _ in range(layers)])
    return (f"{backend.name} step, {str(dtype)[6:]}: {step:.2f} ms = {split} + attention {attention:.2f} ms "
            f"+ rest {step - product_ms - attention:.2f} ms")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", choices=("100m", "smollm2"))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activations", choices=("float32", "q8"), default="float32",
                        help="smollm2's block products: float32 activations, or rounded to 8 bits")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.model, args.activations)
    dtypes = (torch.float32,) if args.model == "smollm2" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:  # (smollm2's blocks run as stored: float32 around them)
        print(f"{args.model}, {args.context} tokens, {measure(model, dtype, args.context)}")


if __name__ == "__main__":
    main()
