"""The half step (bfloat16 / float16 weights on CPU) against the oracles: on many random shapes,
families and batches of rows of their own lengths on a paged cache, its logits are as close to a
float32 forward of the very same weights as the model's own torch forward in that dtype (within
twice its error); its greedy tokens equal transformers' in that dtype on a local checkpoint; a
model written to since the backend was built gets a new one (an interrupted step:
tests/model/test_interrupted_forward.py)."""

from __future__ import annotations

import pytest
import torch
from backend_runs import paged_logits
from tiny_models import OwnErrors, random_model, tiny_config

from kvcache import generate, load_model
from kvcache.backends import (
    BackendError,
    HalfBackend,
    TorchBackend,
    choose_backend,
)
from kvcache.backends.cpu import huge_pages

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)

# config.json overrides: GQA groups, biases, per-head q/k norms, a window
FAMILIES = {
    "llama, 2 groups": dict(),
    "llama, MHA, biases": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "llama, 1 kv head": dict(num_key_value_heads=1),
    "qwen2 (q/k/v bias)": dict(model_type="qwen2"),
    "qwen3 (q/k norms)": dict(model_type="qwen3", head_dim=16),
    "mistral, window 5": dict(model_type="mistral", sliding_window=5),
}
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]


def _half_and_exact(overrides: dict, dtype: torch.dtype, seed: int):
    """A random model in `dtype`, and a float32 model holding exactly its (rounded) weights."""
    half = random_model(tiny_config(**overrides), seed).to(dtype)
    exact = random_model(tiny_config(**overrides), seed)
    exact.load_state_dict({name: value.float() for name, value in half.state_dict().items()})
    return half, exact


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_are_within_the_torch_forwards_own_error_of_a_float32_forward(family, dtype):
    """Errors are measured against a float32 forward of the same (rounded) weights, in units of
    the dtype's eps times the step's largest logit. Rounding makes each step's error a draw, so
    the property is over the family's 3 batches × (the prompt and 5 steps): the half step's mean
    error within 1.25× the torch forward's in that dtype, and its worst within 2× of theirs."""
    errors = OwnErrors(dtype)
    for seed, lengths in enumerate([(7,), (9, 4), (6, 10, 3)]):
        half, exact = _half_and_exact(FAMILIES[family], dtype, seed)
        generator = torch.Generator().manual_seed(seed)
        rows = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in lengths]
        steps = torch.randint(0, 64, (len(lengths), 5), generator=generator)
        ours = paged_logits(half, HalfBackend(half), rows, steps)
        theirs = paged_logits(half, TorchBackend(half), rows, steps)
        with torch.no_grad():
            for step, (mine, reference) in enumerate(zip(ours, theirs)):
                truth = torch.stack([
                    exact(torch.tensor([row + steps[index, :step].tolist()]), use_cache=False).logits[0, -1]
                    for index, row in enumerate(rows)
                ])
                errors.add(mine, reference, truth)
    errors.check()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers_in_the_same_dtype_but_at_a_near_tie(checkpoints, arch, dtype):
    """Greedy tokens equal transformers' in the same dtype; where they part (the prompt and every
    step ran on kernels that sum in float32), the float32 forward of the same weights ranks the
    two tokens within the dtype's rounding of each other (a near-tie)."""
    dtype = str(dtype).removeprefix("torch.")
    folder, hf = checkpoints[arch]
    model = load_model(folder, dtype=dtype)
    assert isinstance(choose_backend(model), HalfBackend)  # auto picks it
    ids = torch.randint(3, 259, (1, 9), generator=torch.Generator().manual_seed(5))
    ours = generate(model, ids, max_new_tokens=12, eos_token_id=(), backend="half")
    assert ours.backend == "half"
    theirs_model = type(hf)(hf.config).to(getattr(torch, dtype)).eval()
    theirs_model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in hf.state_dict().items()})
    with torch.no_grad():
        theirs = theirs_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
    mine, reference = ours.new_tokens[0], theirs[0, ids.shape[1]:].tolist()
    if mine != reference:  # rounding in another order may flip a near-tie, and only one
        first = next(i for i, (a, b) in enumerate(zip(mine, reference)) if a != b)
        exact = load_model(folder)
        with torch.no_grad():
            logits = exact(torch.tensor([ids[0].tolist() + mine[:first]]), use_cache=False).logits[0, -1]
        gap = float(logits[reference[first]] - logits[mine[first]]).__abs__()
        eps = torch.finfo(getattr(torch, dtype)).eps
        assert gap <= 8 * eps * float(logits.abs().max()), (first, gap)


def test_a_model_written_to_since_gets_a_new_backend():
    model = random_model(tiny_config(), 4).to(torch.bfloat16)
    first = choose_backend(model)
    assert choose_backend(model) is first
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)  # in place: the copy is stale
    assert not first.matches(model)
    rebuilt = choose_backend(model)
    assert rebuilt is not first and rebuilt.matches(model)
    # two rows: oneDNN's products on the laid-out copy (one bfloat16 token reads the model's own
    # parameters in place, which see the write)
    ids = torch.tensor([[3, 9, 4, 1], [5, 2, 8, 6]])
    step = torch.tensor([[7], [7]])
    stale, fresh, theirs = (paged_logits(model, backend, ids, step)[-1]
                            for backend in (first, rebuilt, TorchBackend(model)))
    assert (fresh - theirs).abs().max() < (stale - theirs).abs().max()


def test_it_refuses_what_it_cannot_run_by_name():
    gemma = random_model(tiny_config(model_type="gemma2", query_pre_attn_scalar=8), 0).to(torch.bfloat16)
    with pytest.raises(BackendError, match="gemma2"):
        HalfBackend(gemma)
    assert isinstance(choose_backend(gemma), TorchBackend)
    with pytest.raises(BackendError, match="bfloat16 or float16"):
        HalfBackend(random_model(tiny_config(), 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_kernels_read_the_models_own_parameters(dtype):
    model = random_model(tiny_config(), 5).to(dtype)
    backend = HalfBackend(model)
    layer = backend.row_layers[0][0]  # the kernels read the model's own parameters
    assert layer.down[0].ctypes.data == model.model.layers[0].mlp.down_proj.weight.data_ptr()


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="no transparent huge pages on this OS")
def test_the_parameters_move_onto_one_huge_page_block_values_and_ties_kept(monkeypatch):
    model = random_model(tiny_config(tie_word_embeddings=True), 6).to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    parameters = list(model.parameters())
    backend = HalfBackend(model)
    assert list(model.parameters()) == parameters  # the same Parameter objects, re-pointed
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.dtype == torch.bfloat16
    pointers = sorted(p.data_ptr() for p in model.parameters())
    assert pointers[0] % huge_pages.HUGE_PAGE == 0  # one block on a 2 MB boundary
    assert backend.matches(model)
    monkeypatch.setattr(huge_pages, "MOVE_LIMIT", 1024)  # past the limit: nothing moves
    other = random_model(tiny_config(), 6).to(torch.bfloat16)
    kept = [p.data_ptr() for p in other.parameters()]
    HalfBackend(other)
    assert [p.data_ptr() for p in other.parameters()] == kept
