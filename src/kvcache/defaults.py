"""Where kvcache's bundled default model lives, and what kind of path a model path is
(standard library only, so that telling a GGUF file from a folder imports nothing heavy).

The default model is a ~3M-parameter Llama trained by `scripts/train_default_model.py` on text
shipped with Python; it is a standard Hugging Face checkpoint folder inside the package, used
by `kvcache.load_model()` / `load_tokenizer()` with no path and by every CLI command without
`--model`.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / "default_model"


def default_model_dir() -> Path:
    """The bundled checkpoint folder (config.json, model.safetensors, tokenizer.json, …)."""
    return DEFAULT_MODEL_DIR


def resolve_model_dir(path: str | Path | None) -> Path | str:
    """`path` as given, or the bundled default model's folder when it is None."""
    return DEFAULT_MODEL_DIR if path is None else path


GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC
