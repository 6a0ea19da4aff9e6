"""How far a quantized KV cache moves a model's output, measured against the unquantized cache.

    results = measure_drift(model, prompts, [DriftSetting(8), DriftSetting(4), DriftSetting("fp8")])
    results[0].to_dict()   # bits, kind, max_abs_logit_diff, mean_kl, greedy_agreement, …

For each prompt the unquantized (dynamic) cache gives the reference: N greedy tokens and the
next-token logits at each of the N steps (the prefill's last position, then N - 1 decode steps).
Each setting is then run on the same prompt:
- teacher-forced: fed the reference tokens, so its logits compare position by position:
  max |Δlogit|, mean KL(reference ‖ quantized) of the next-token distributions, and the
  fraction of steps whose argmax is still the reference token;
- free-running: greedy on its own tokens; the fraction of the N positions whose token equals
  the reference's, and the first position where they differ.
Until its first differing token the free run is fed exactly the reference tokens, so the two
runs coincide there and the teacher-forced run is only made when the free run diverges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvcache.defaults import default_model_dir  # noqa: F401  (re-exported for the CLI)

DEFAULT_PROMPTS = (
    "The for statement is used to iterate over the elements of a sequence",
    'def read_config(path):\n    """Read the configuration file at path and return',
    "<|user|>\nWhat is a generator in Python?<|end|>\n<|assistant|>\n",
)


@dataclass(frozen=True)
class Tolerance:
    """What "within tolerance" means for a quantized cache: the same greedy decisions and a
    next-token distribution that has barely moved.

    greedy_agreement: least fraction of the N free-running tokens equal to the reference's.
    teacher_forced_agreement: least fraction of teacher-forced steps whose argmax is unchanged.
    mean_kl: largest mean KL(reference ‖ quantized) in nats.
    """

    greedy_agreement: float = 0.99
    teacher_forced_agreement: float = 0.99
    mean_kl: float = 1e-3


@dataclass(frozen=True)
class DriftSetting:
    """One quantized cache to measure: `QuantizedCache` arguments."""

    bits: int | str = 8
    group_size: int = 32
    residual_length: int = 32
    key_axis: str = "channel"
    value_axis: str = "token"

    @property
    def kind(self) -> str:
        return "fp8" if self.bits == "fp8" else "int"

    def make_cache(self, config, device=None):
        from kvcache.cache import make_cache

        return make_cache(
            "quantized",
            config=config,
            device=device,
            bits=self.bits,
            group_size=self.group_size,
            residual_length=self.residual_length,
            key_axis=self.key_axis,
            value_axis=self.value_axis,
        )


@dataclass
class DriftResult:
    """The figures of one setting over every prompt (see the module docstring)."""

    setting: DriftSetting
    tokens: int
    prompts: int
    max_abs_logit_diff: float
    mean_kl: float
    max_kl: float
    teacher_forced_agreement: float
    greedy_agreement: float
    first_divergence: list[int | None]
    bytes_per_token: float
    reference_bytes_per_token: int
    cache_bytes: int
    reference_cache_bytes: int
    quantized_fraction: float
    tolerance: Tolerance = field(default_factory=Tolerance)

    @property
    def within_tolerance(self) -> bool:
        """The figures pass the tolerance, and something was quantized (a run whose tokens all
        stayed in the full-precision residual measured nothing and does not pass)."""
        tol = self.tolerance
        return (
            self.quantized_fraction > 0
            and self.greedy_agreement >= tol.greedy_agreement
            and self.teacher_forced_agreement >= tol.teacher_forced_agreement
            and self.mean_kl <= tol.mean_kl
        )

    def to_dict(self) -> dict:
        """A flat JSON-ready dict: bits, kind, the settings, the figures and within_tolerance."""
        setting = asdict(self.setting)
        setting["bits"] = 8 if self.setting.bits == "fp8" else self.setting.bits
        figures = {k: v for k, v in asdict(self).items() if k not in ("setting", "tolerance")}
        return {
            **setting,
            "kind": self.setting.kind,
            **figures,
            "within_tolerance": self.within_tolerance,
            "tolerance": asdict(self.tolerance),
        }


@dataclass
class _Run:
    tokens: list[int]  # N greedy tokens
    logits: torch.Tensor  # (N, vocab) float32, the logits each token was chosen from
    cache: object


def _greedy_run(model, prompt: torch.Tensor, cache, steps: int, forced: Sequence[int] | None = None) -> _Run:
    """Prefill `prompt` (T,) then decode: N tokens chosen greedily, or fed from `forced`."""
    tokens: list[int] = []
    rows = []
    logits = model(prompt[None], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    for step in range(steps):
        row = logits[0, -1].float()  # (vocab,)
        rows.append(row)
        tokens.append(int(row.argmax()) if forced is None else int(forced[step]))
        if step + 1 < steps:
            feed = torch.tensor([[tokens[-1]]], device=prompt.device)
            logits = model(feed, past_key_values=cache, use_cache=True).logits
    return _Run(tokens, torch.stack(rows), cache)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p_other) per row of logits (N, vocab), in nats, float64."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(other.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.inference_mode()
def measure_drift(
    model,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    settings: Sequence[DriftSetting],
    *,
    tokens: int = 128,
    tolerance: Tolerance = Tolerance(),
    progress: Callable[[str], None] | None = None,
) -> list[DriftResult]:
    """Measure each setting against the unquantized cache on every prompt (token ids, (T,)).

    tokens: N, greedy tokens generated per prompt. progress: called with a short line before
    each run (the CLI prints it on stderr).
    """
    from kvcache.cache import make_cache

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if not prompts:
        raise ValueError("measure_drift needs at least one prompt")
    device = model.device
    prompt_ids = [torch.as_tensor(p, dtype=torch.long, device=device).reshape(-1) for p in prompts]
    config = model.config
    say = progress or (lambda message: None)

    references = []
    for index, prompt in enumerate(prompt_ids):
        say(f"reference (unquantized cache), prompt {index + 1}/{len(prompt_ids)}")
        cache = make_cache("dynamic", config=config, device=device)
        references.append(_greedy_run(model, prompt, cache, tokens))

    return [
        _setting_drift(model, setting, prompt_ids, references, tokens, tolerance, say) for setting in settings
    ]


def _setting_drift(model, setting: DriftSetting, prompt_ids, references, tokens: int, tolerance: Tolerance,
                   say: Callable[[str], None]) -> DriftResult:
    """One setting's runs on every prompt (free-running, and teacher-forced where it diverged
    from its reference run), summarised."""
    from kvcache.cache import QuantizedLayer

    config, device = model.config, model.device
    diffs, kls, forced_agree, free_agree, divergence = [], [], [], [], []
    cache_bytes = reference_bytes = quantized = held = 0
    for index, (prompt, reference) in enumerate(zip(prompt_ids, references)):
        say(f"{setting.kind}{setting.bits if setting.kind == 'int' else ''} "
            f"prompt {index + 1}/{len(prompt_ids)}: free-running")
        free = _greedy_run(model, prompt, setting.make_cache(config, device), tokens)
        same = [a == b for a, b in zip(free.tokens, reference.tokens)]
        first = None if all(same) else same.index(False)
        forced = free
        if first is not None:
            say(f"  diverged at token {first}: teacher-forced run")
            forced = _greedy_run(model, prompt, setting.make_cache(config, device), tokens, reference.tokens)
        diffs.append(float((forced.logits - reference.logits).abs().max()))
        kls.append(_kl(reference.logits, forced.logits))
        forced_agree.append(forced.logits.argmax(-1).cpu() == torch.tensor(reference.tokens))
        free_agree.append(sum(same) / tokens)
        divergence.append(first)
        cache_bytes += free.cache.nbytes_used
        reference_bytes += reference.cache.nbytes_used
        layers = [layer for layer in free.cache.layers if isinstance(layer, QuantizedLayer)]
        quantized += sum(layer.quantized_tokens for layer in layers)
        held += sum(layer.get_seq_length() for layer in layers)
    per_token, reference_per_token = _bytes_per_token(model, setting, free.cache)
    kl = torch.cat(kls)
    return DriftResult(
        setting=setting, tokens=tokens, prompts=len(prompt_ids), max_abs_logit_diff=max(diffs),
        mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        teacher_forced_agreement=float(torch.cat(forced_agree).double().mean()),
        greedy_agreement=sum(free_agree) / len(free_agree), first_divergence=divergence,
        bytes_per_token=per_token, reference_bytes_per_token=reference_per_token,
        cache_bytes=cache_bytes, reference_cache_bytes=reference_bytes,
        quantized_fraction=quantized / held if held else 0.0, tolerance=tolerance,
    )


def _bytes_per_token(model, setting: DriftSetting, cache) -> tuple[float, float]:
    """(bytes a token costs in `cache`'s layers at `setting`, packed as one whole group with no
    residual, the other layers unquantized; bytes it costs unquantized)."""
    from kvcache.cache import QuantizedLayer
    from kvcache.memory import kv_cache_bytes, quantized_kv_cache_bytes

    dtype_name = str(model.dtype).removeprefix("torch.")
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    quantized_layers = sum(isinstance(layer, QuantizedLayer) for layer in cache.layers)
    group = setting.group_size
    packed = quantized_kv_cache_bytes(
        quantized_layers, heads, group, dim, bits=setting.bits, group_size=group,
        residual_length=0, dtype=dtype_name, key_axis=setting.key_axis, value_axis=setting.value_axis,
    ) / group
    all_layers = len(cache.layers)
    other = kv_cache_bytes(all_layers - quantized_layers, heads, 1, dim, 1, dtype_name)
    return packed + other, kv_cache_bytes(all_layers, heads, 1, dim, 1, dtype_name)


def drift_table(results: Sequence[DriftResult]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| cache | max abs Δlogit | mean KL (nats) | teacher-forced agreement | greedy agreement "
        "(free-running) | bytes/token | quantized share | within tolerance |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        s = r.setting
        name = f"{'fp8' if s.kind == 'fp8' else f'int{s.bits}'} g{s.group_size} r{s.residual_length}"
        ratio = r.reference_bytes_per_token / r.bytes_per_token
        lines.append(
            f"| {name} | {r.max_abs_logit_diff:.4g} | {r.mean_kl:.3g} | {r.teacher_forced_agreement:.3f} | "
            f"{r.greedy_agreement:.3f} | {_bytes(r.bytes_per_token)} ({ratio:.2f}× smaller) | "
            f"{r.quantized_fraction:.0%} | "
            f"{'yes' if r.within_tolerance else 'NO' if r.quantized_fraction else 'nothing quantized'} |"
        )
    return "\n".join(lines)


def _bytes(value: float) -> str:
    return f"{value:.0f}" if math.isclose(value, round(value)) else f"{value:.1f}"
