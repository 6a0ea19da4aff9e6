"""The serving engine: continuous batching over one paged KV pool, with prefix sharing across
requests (`Engine`, its settings `PoolConfig` and `SchedulerConfig`), its pure scheduler
(`schedule`), per-request sampling (`SamplingParams`) and what a request gives back
(`RequestHandle`, `Completion`, `Usage`)."""

from kvcache.engine.config import PoolConfig, SchedulerConfig
from kvcache.engine.engine import Engine
from kvcache.engine.metrics import EngineMetrics
from kvcache.engine.request import FINISH_REASONS, Completion, RequestHandle, Usage
from kvcache.engine.scheduler import Limits, Plan, RunningSeq, WaitingSeq, schedule
from kvcache.generation.params import RequestError, SamplingParams

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "Engine",
    "EngineMetrics",
    "Limits",
    "Plan",
    "PoolConfig",
    "RequestError",
    "RequestHandle",
    "RunningSeq",
    "SamplingParams",
    "SchedulerConfig",
    "Usage",
    "WaitingSeq",
    "schedule",
]
