"""NaN or inf logits end generation with a named error (the CLI exits 2), never a stream of
token 0 that looks like an answer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import llama_checkpoint, tiny_model

import kvcache
from kvcache.engine import Engine
from kvcache.generation.sampling import NonFiniteLogitsError

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def broken(model, value: float):
    with torch.no_grad():
        model.lm_head.weight[7, 3] = value  # one weight: token 7's logit is not finite
    return model


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["torch", "float32"])
def test_generate_stops_with_a_named_error_on_non_finite_logits(value, backend):
    model = broken(tiny_model(), value)
    with pytest.raises(NonFiniteLogitsError, match=r"not finite .* rows \[0\]"):
        kvcache.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4, backend=backend)


def test_the_engine_fails_only_the_request_whose_logits_are_not_finite():
    engine = Engine(broken(tiny_model(), float("nan")), num_blocks=16, block_size=4)
    completion = engine.generate([[1, 2, 3]])[0]
    assert completion.finish_reason == "error" and "not finite" in completion.error
    assert completion.tokens == []


def test_the_cli_exits_2_naming_the_fault(tmp_path):
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=272, max_position_embeddings=64)
    folder = llama_checkpoint(tmp_path / "m", seed=0, **sizes)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    command = [sys.executable, "-m", "kvcache", "generate", "--model", str(folder), "--prompt", "Hi",
               "--max-new-tokens", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "not finite" in done.stderr and "Traceback" not in done.stderr
