"""What `kvcache report` measures and how much of it: the full run and the quick one (standard
library only).

`ReportSettings.for_run()` takes a few minutes on the default model; `for_run(quick=True)` gives
the same figures on smaller ranges, well under a minute (the test suite runs it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ReportSettings:
    """Sizes of every part of the report.

    count_d / count_lengths: the counted single head (width d) and the context lengths of its table.
    latency_lengths / latency_repeats: contexts of the decode-step timing and timed steps per
    context (each path; medians with min–max).
    equality_new_tokens / equality_window / equality_block_size: greedy tokens decoded per cache kind
    after the prompt, the window of the sliding checks, the paged cache's block size.
    rounding_bits / rounding_tokens: significant bits k and v keep in the reference's rounding
    experiment, and its sequence length.
    drift_bits / drift_tokens / drift_prompts / drift_group_size / drift_residual: the engine's
    quantized caches, greedy tokens per prompt, prompts used, group and full-precision residual.
    memory_lengths / memory_dtypes / budget_bytes / capacity_tokens: the memory figures, the budget
    capacity is counted in, and the sequence length of "sequences that fit".
    """

    quick: bool = False
    count_d: int = 8
    count_lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    latency_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    latency_repeats: int = 15
    equality_new_tokens: int = 300
    equality_window: int = 32
    equality_block_size: int = 16
    rounding_bits: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 11, 14, 17, 20, 24, 28, 32, 40, 48)
    rounding_tokens: int = 32
    drift_bits: tuple[int | str, ...] = (8, 4, "fp8")
    drift_tokens: int = 128
    drift_prompts: int = 3
    drift_group_size: int = 32
    drift_residual: int = 32
    memory_lengths: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    memory_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float8_e4m3fn", "int4")
    budget_bytes: int = 24 * 2**30
    capacity_tokens: int = 4096
    seed: int = 0

    @classmethod
    def for_run(cls, quick: bool = False, **changes) -> ReportSettings:
        """The full report (a few minutes on the default model), or with `quick` the same
        figures on smaller ranges (well under a minute); `changes` override single fields."""
        if not quick:
            return cls(**changes)
        small = dict(
            quick=True,
            count_lengths=(1, 2, 4, 8, 16, 32, 64),
            latency_lengths=(16, 64, 256),
            latency_repeats=3,
            equality_new_tokens=40,
            rounding_bits=(3, 4, 8, 11, 24, 48),
            rounding_tokens=16,
            drift_tokens=16,
            drift_prompts=1,
        )
        small.update(changes)
        return cls(**small)

    def to_dict(self) -> dict:
        """JSON-ready: tuples become lists."""
        return {key: list(value) if isinstance(value, tuple) else value
                for key, value in asdict(self).items()}
