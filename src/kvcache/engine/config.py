"""The engine's settings in two groups, each a frozen dataclass checked when made (a RequestError
naming the field, what was expected and what was given):

- `PoolConfig`: the KV pool (its bytes or blocks, block size, prefix caching, the dtype its rows
  are stored in, a full-precision window, a second tier of blocks);
- `SchedulerConfig`: what one step may run (rows at once, tokens a step, how much a prompt may
  slow the decoding rows).

    Engine(model, tokenizer, pool=PoolConfig(kv_budget="1GiB", kv_dtype="int8"),
           scheduler=SchedulerConfig(max_running=32, token_budget=512))

`Engine(model, kv_budget=..., max_running=...)` is the same: each keyword is the field of one
config (`configs_from`), the one path the engine reads its settings by.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvcache.generation.params import RequestError
from kvcache.memory import parse_size


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PoolConfig:
    """The engine's KV pool.

    kv_budget: bytes for keys and values (an int, or "256MiB"); the pool holds as many whole
    blocks as `kvcache.memory` says fit. num_blocks: the pool's size in blocks instead (then
    kv_budget is not read). block_size: tokens a block. prefix_caching: attach cached blocks of
    earlier prompts that start the same way (False: every prompt is prefilled whole). kv_dtype:
    what the pool stores keys and values as, "bfloat16", "float16", or quantized "fp8", "int8",
    "int4", keys and values apart as "int8/int4" (`kvcache.cache.paged.formats`); None: the
    model's dtype. kv_window: with kv_dtype, each running row's last kv_window tokens also kept
    in the model's dtype (its bytes come out of kv_budget); 0: none. kv_store: a second tier of
    prefix blocks shared with other replicas: a URL ("redis://127.0.0.1:6379/0") or a store
    object; None: none.
    """

    kv_budget: int | str | None = "256MiB"
    num_blocks: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    kv_dtype: str | None = None
    kv_window: int = 0
    kv_store: object = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks < 1):
            raise RequestError(f"num_blocks must be an int >= 1 or None, got {self.num_blocks!r}")
        if self.num_blocks is None:
            self._check_budget()
        if not _is_int(self.block_size) or self.block_size < 1:
            raise RequestError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.prefix_caching, bool):
            raise RequestError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        if self.kv_dtype is not None and not isinstance(self.kv_dtype, str):
            raise RequestError(f"kv_dtype must be a name such as \"int8\", or None; got {self.kv_dtype!r}")
        if not _is_int(self.kv_window) or self.kv_window < 0:
            raise RequestError(f"kv_window must be an int >= 0, got {self.kv_window!r}")

    def _check_budget(self) -> None:
        """kv_budget an int > 0 or a size ("256MiB"); whether it holds a block is the pool's to say."""
        budget = self.kv_budget
        if isinstance(budget, str):
            try:
                budget = parse_size(budget)
            except ValueError as error:
                raise RequestError(f"kv_budget: {error}") from None
        if not _is_int(budget) or budget < 1:
            raise RequestError(
                f"kv_budget must be bytes (an int >= 1, or a size such as \"256MiB\") when num_blocks "
                f"is None, got {self.kv_budget!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may run.

    max_running: sequences holding a row at once. token_budget: tokens one step runs (decode
    rows and prefill chunks together, at least max_running), so a long prompt is prefilled in
    chunks while the others keep decoding. prefill_slowdown: while rows decode, a step with
    prompt tokens costs at most about this many steps of those rows alone (> 1; its prompt
    tokens capped by step costs measured as the engine runs: `step_costs`); None: only
    token_budget bounds them.
    """

    max_running: int = 16
    token_budget: int = 256
    prefill_slowdown: float | None = 2.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_running) or self.max_running < 1:
            raise RequestError(f"max_running must be an int >= 1, got {self.max_running!r}")
        if not _is_int(self.token_budget) or self.token_budget < self.max_running:
            raise RequestError(
                f"token_budget must be an int >= max_running ({self.max_running}), got {self.token_budget!r}"
            )
        slowdown = self.prefill_slowdown
        if slowdown is not None and (isinstance(slowdown, bool) or not isinstance(slowdown, (int, float))
                                     or not slowdown > 1):
            raise RequestError(
                f"prefill_slowdown must be a number > 1 (a step with prompt tokens costs more) or None, "
                f"got {slowdown!r}"
            )


def configs_from(pool: PoolConfig | None, scheduler: SchedulerConfig | None,
                 settings: dict) -> tuple[PoolConfig, SchedulerConfig]:
    """The two configs, with each of `settings` (keywords such as kv_budget=, max_running=) set
    as the field of the one config that has it. A TypeError names a keyword no config has, and
    one given beside a config that it would change."""
    groups = {}
    for kind, given in ((PoolConfig, pool), (SchedulerConfig, scheduler)):
        names = {field.name for field in dataclasses.fields(kind)}
        mine = {name: value for name, value in settings.items() if name in names}
        if mine and given is not None:
            raise TypeError(f"Engine() got {', '.join(mine)} beside a {kind.__name__}: set them in it")
        groups[kind] = given if given is not None else kind(**mine)
    unknown = set(settings) - {f.name for kind in groups for f in dataclasses.fields(kind)}
    if unknown:
        raise TypeError(f"Engine() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    return groups[PoolConfig], groups[SchedulerConfig]
