"""load_model: strict, name-for-name safetensors loading from a local folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS, hf_model, save_checkpoint

from kvcache import load_model
from kvcache.model import CheckpointError, LlamaForCausalLM
from kvcache.model.load import unfuse


def _rewrite(folder, edit) -> None:
    """Apply `edit` to the tensors of folder/model.safetensors and save them back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ARCHS)
def test_module_names_equal_checkpoint_keys_and_values(checkpoints, arch):
    """Module names are the checkpoint's keys; phi3's fused projections are split into the
    projections every family has (its stored rows, in order)."""
    folder, hf = checkpoints[arch]
    model = load_model(folder)
    assert isinstance(model, LlamaForCausalLM) and not model.training
    stored = unfuse(model.config, load_file(str(folder / "model.safetensors")))
    ours = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(ours) - tied == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(ours[name], tensor), name
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_loads_the_same_tensors(checkpoints, tmp_path):
    folder, hf = checkpoints["llama"]
    sharded = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    one, many = load_model(folder).state_dict(), load_model(sharded).state_dict()
    assert one.keys() == many.keys()
    assert all(torch.equal(one[name], many[name]) for name in one)


def test_dtype_converts_every_tensor(llama_dir):
    model = load_model(llama_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert load_model(llama_dir, dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(llama_dir, dtype="int8")


def test_missing_tensor_is_named(llama_copy):
    _rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(llama_copy)


def test_unexpected_tensor_is_named(llama_copy):
    _rewrite(llama_copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"does not know.*q_proj\.bias"):
        load_model(llama_copy)


def test_misshaped_tensor_is_named_with_both_shapes(llama_copy):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _rewrite(llama_copy, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight .*\(16, 64\), expected \(32, 64\)"):
        load_model(llama_copy)


def test_bin_only_folder_is_refused_with_a_conversion_hint(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    torch.save({}, llama_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only.*safe_serialization=True"):
        load_model(llama_copy)


def test_hub_name_is_refused_without_network():
    with pytest.raises(CheckpointError, match="no such file or folder.*looks like a Hugging Face hub id"):
        load_model("meta-llama/Llama-2-7b-chat-hf")


def test_shard_index_naming_a_missing_file_is_an_error(checkpoints, tmp_path):
    sharded = save_checkpoint(checkpoints["llama"][1], tmp_path / "sharded", max_shard_size="60KB")
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(sharded)


def test_unsupported_architecture_is_refused(llama_copy):
    raw = json.loads((llama_copy / "config.json").read_text())
    raw["model_type"] = "gemma3"
    (llama_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="model_type .gemma3. is not supported"):
        load_model(llama_copy)


def test_qwen2_biases_are_loaded(checkpoints):
    model = load_model(checkpoints["qwen2"][0])
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    assert attention.k_proj.bias.abs().sum() > 0  # the fixture randomised them


def test_llama_attention_bias_checkpoint_round_trips(tmp_path):
    hf = hf_model("llama", attention_bias=True, mlp_bias=True)
    folder = save_checkpoint(hf, tmp_path / "biased")
    model = load_model(folder)
    ids = torch.randint(3, 259, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_phi3s_fused_projections_are_split_in_their_stored_order(checkpoints):
    folder, hf = checkpoints["phi3"]
    model = load_model(folder)
    fused = hf.model.layers[0].self_attn.qkv_proj.weight
    attn = model.model.layers[0].self_attn
    ours = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(ours, fused)
    mlp = model.model.layers[0].mlp
    fused = hf.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), fused)


@pytest.mark.processes
def test_loading_a_model_does_not_import_torchs_compiler():
    """nn.Embedding's own initialisation (init.normal_) imports torch._dynamo, about a second of
    start-up for every command, for a tensor the checkpoint overwrites."""
    import subprocess
    import sys

    script = "import sys, kvcache; kvcache.load_model(); print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
