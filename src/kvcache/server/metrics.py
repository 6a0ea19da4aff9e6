"""The server's Prometheus metrics (`GET /metrics`), on a registry of its own (two servers in one
process do not share counters). Gauges are read from the engine when scraped; counters and
histograms are updated as requests end."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcache.engine import Completion

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: KL divergences (nats) of the drift probe's positions: from rounding noise to a changed answer
DRIFT_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


class ServerMetrics:
    """Requests by outcome, queue depth, running sequences, KV blocks, prefix hit rate, TTFT and
    inter-token latency histograms (seconds), tokens generated."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, context: int = 0) -> None:
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "kvcache_requests",
            "Requests by outcome (finish reason, or the HTTP error)",
            ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvcache_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.cached_tokens = Counter(
            "kvcache_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=registry
        )
        self.generated = Counter("kvcache_generated_tokens", "Tokens generated", registry=registry)
        self.drafted = Counter("kvcache_spec_drafted_tokens",
                               "Draft tokens verified by speculative decoding (finished requests)",
                               registry=registry)
        self.accepted = Counter("kvcache_spec_accepted_tokens",
                                "Of the draft tokens verified, the ones taken", registry=registry)
        self.prefix_causes = Counter("kvcache_prefix_explained",
                                     "Requests by why their prompt did or did not match an earlier one "
                                     "(usage.kvcache_prefix.cause)", ["cause"], registry=registry)
        self.ttft = Histogram("kvcache_time_to_first_token_seconds", "Time from submit to the first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("kvcache_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.gauges = _gauges(
            registry,
            "kvcache_",
            (
                ("waiting", "Requests queued, not yet holding a row"),
                ("running", "Sequences holding a row in the KV pool"),
                ("preemptions", "Sequences preempted (freed and requeued) since start"),
                ("blocks_used", "KV blocks held by running sequences"),
                ("blocks_free", "KV blocks never used or freed without a hash"),
                ("blocks_cached", "KV blocks of finished requests kept for prefix reuse"),
                ("blocks_total", "KV blocks in the pool"),
                ("kv_cache_utilization", "Share of the pool's KV blocks held by running sequences, 0 to 1"),
                ("prefix_hit_rate", "Share of admitted prompt tokens served from the prefix cache"),
            ),
        )

        if engine.store_tier is not None:  # the tiers below the pool, counted since start
            registry.register(_TierCollector(engine))
        self.drift_kl = Histogram("kvcache_kv_drift_kl",
                                  "KL(p_exact || p_quantized) of each position the KV drift probe ran (nats)",
                                  buckets=DRIFT_BUCKETS, registry=registry)
        self.drift_agreements = Counter(
            "kvcache_kv_drift_top1_agreements", "Probed positions whose greedy tokens agreed",
            registry=registry,
        )
        if context:
            registry.register(_CapacityCollector(engine, context))

    def explained(self, cause: str) -> None:
        self.prefix_causes.labels(cause=cause).inc()

    def rejected(self, status: int) -> None:
        self.requests.labels(outcome=f"http_{status}").inc()

    def finished(self, completion: Completion) -> None:
        self.requests.labels(outcome=completion.finish_reason).inc()
        usage = completion.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generated.inc(len(completion.tokens))
        self.drafted.inc(usage.drafted_tokens)
        self.accepted.inc(usage.accepted_tokens)
        if completion.time_to_first_token_s is not None:
            self.ttft.observe(completion.time_to_first_token_s)
        times = completion.token_times_s
        for earlier, later in zip(times, times[1:]):
            self.itl.observe(later - earlier)
        if completion.kv_drift is not None:
            for divergence in completion.kv_drift.kl:
                self.drift_kl.observe(divergence)
            self.drift_agreements.inc(completion.kv_drift.agreements)

    def render(self) -> bytes:
        stats = self.engine.stats()
        for name, gauge in self.gauges.items():
            gauge.set(stats[name])
        return generate_latest(self.registry)


_TIER_COUNTS = (
    ("lookups", "Requests whose prompt blocks were looked up in the tier"),
    ("found_blocks", "Blocks the tier returned to a lookup"),
    ("invalid_blocks", "Blocks read back and refused (size, checksum, namespace): recomputed"),
    ("read_bytes", "Bytes read from the tier"),
    ("written_blocks", "Blocks written to the tier"),
    ("written_bytes", "Bytes written to the tier"),
    ("dropped_blocks", "Blocks not written (queue full, tier down or failing)"),
    ("errors", "Failed calls"),
    ("outages", "Times the tier became unavailable"),
)


class _TierCollector:
    """The KV tiers' counts, read from the engine when scraped: per tier (label `tier`: disk,
    redis) and, for what the engine used, in all."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        store = stats["kv_store"]
        tiers = store.get("tiers") or {"": store}
        for name, help_text in _TIER_COUNTS:
            family = CounterMetricFamily(f"kvcache_kv_tier_{name}", help_text, labels=["tier"])
            for counts in tiers.values():
                family.add_metric([counts["kind"]], float(counts[name]))
            yield family
        up = GaugeMetricFamily("kvcache_kv_tier_up", "1 while the tier answers, 0 during an outage",
                               labels=["tier"])
        for counts in tiers.values():
            up.add_metric([counts["kind"]], float(counts["up"]))
        yield up
        counts, tokens = self.engine.metrics, store["hit_blocks"] * self.engine.limits.block_size
        for name, help_text, value in (
            ("hit_blocks", "Blocks from the tiers written into the pool, not computed", store["hit_blocks"]),
            ("tokens_served", "Prompt tokens served from the tiers", tokens),
            ("prefill_seconds_saved", "Prefill those tokens would have taken, each once at what one more "
             "prompt token adds to a step, measured on this engine's steps", counts.prefill_seconds_saved),
        ):
            yield CounterMetricFamily(f"kvcache_kv_store_{name}", help_text, value=float(value))


def _gauges(registry, prefix: str, described) -> dict:
    """name -> Gauge `prefix + name` on `registry`, for each (name, help text) in `described`."""
    return {name: Gauge(f"{prefix}{name}", help_text, registry=registry) for name, help_text in described}


class _CapacityCollector:
    """How many sequences of the server's context the pool's bytes hold at each KV dtype, scales
    counted (`Engine.capacity_by_kv_dtype`; label `kv_dtype`)."""

    def __init__(self, engine, context: int) -> None:
        self.engine, self.context = engine, context

    def collect(self):
        family = GaugeMetricFamily(
            "kvcache_kv_capacity_sequences",
            f"Sequences of {self.context} tokens (the context) the KV pool's bytes hold at once, by KV dtype",
            labels=["kv_dtype"],
        )
        for dtype, count in self.engine.capacity_by_kv_dtype(self.context).items():
            family.add_metric([dtype], float(count))
        yield family
