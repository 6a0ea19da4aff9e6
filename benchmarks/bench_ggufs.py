"""GGUF files (F32 and F16) of bench_decode.py's models, for llama.cpp's llama-bench beside it.

    .venv/bin/python benchmarks/bench_ggufs.py /tmp/ggufs
    # then: bench_decode.py --llama-bench BIN --gguf 100m=DIR/100m-f32.gguf,DIR/100m-f16.gguf

"100m" is bench_decode's random Llama (seed 0), with the test suite's small byte-level tokenizer
padded to its 32,000 tokens (llama-bench feeds token ids, never text); "smollm2" is
SmolLM2-135M-Instruct's Q4_1 weights as transformers dequantizes them, with its own tokenizer.
Both are written by the test suite's GGUF writer (tests/gguf_files.py, llama.cpp's layout).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_decode import build_100m, smollm2_gguf  # noqa: E402
from gguf_files import write_gguf  # noqa: E402
from tiny_models import write_tokenizer  # noqa: E402


def _smollm2_folder(folder: Path) -> Path:
    """A Hugging Face folder of the GGUF's weights as kvcache dequantizes them (float32)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from kvcache import load_model
    from kvcache.model.gguf_file import gguf_config

    source = smollm2_gguf()
    folder.mkdir(parents=True, exist_ok=True)
    model = load_model(source, dtype="float32")  # (without a dtype its weights would stay blocks)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if name != "lm_head.weight"}  # tied
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(gguf_config(source)))
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(chat_template=tokenizer.chat_template, bos_token=tokenizer.bos_token,
                    eos_token=tokenizer.eos_token)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "ggufs")
    out.mkdir(parents=True, exist_ok=True)
    folder = build_100m(out / "100m-hf")
    write_tokenizer(folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = [["a", "b"]]  # llama.cpp refuses a BPE vocabulary without merges
    tokenizer["model"]["vocab"]["ab"] = len(tokenizer["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    smol = _smollm2_folder(out / "smollm2-hf")
    for name, checkpoint, pre in (("100m", folder, "gpt-2"), ("smollm2", smol, "smollm")):
        for kind in ("F32", "F16"):
            path = write_gguf(checkpoint, out / f"{name}-{kind.lower()}.gguf", tensor_type=kind, pre=pre)
            print(path)


if __name__ == "__main__":
    main()
