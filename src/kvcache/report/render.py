"""report.md from the collected figures (`report_markdown(report, plots)`), standard library only."""

from __future__ import annotations

from kvcache.memory import format_bytes


def _yes(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def _spread(figures: dict) -> str:
    return f"{figures['median']:.3g} ({figures['min']:.3g}–{figures['max']:.3g})"


def _image(plots: dict, key: str, alt: str) -> list[str]:
    return [f"![{alt}]({plots[key]})", ""] if key in plots else []


def _counts(report: dict, plots: dict) -> list[str]:
    counts = report["counts"]
    d = counts["d"]
    out = ["## 1. Counted multiplications, with and without the cache", "",
           *_image(plots, "counts", "multiplications per token and in total vs context length"),
           f"One attention head of width d = {d} in `kvcache.reference` (lists of floats; every "
           "multiplication goes through one counter). Closed forms (`kvcache.reference.formulas`): "
           "step t costs 3·t·d² + 2·t·d without a cache and 3·d² + 2·t·d with one; in total "
           "(3d² + 2d)·n(n+1)/2 against 3d²·n + d·n(n+1).", "",
           f"Every counted figure equals its closed form: **{_yes(counts['matches_closed_forms'])}**.", "",
           "| n | no cache: token n | cached: token n | no cache: all n | cached: all n | ratio (all n) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for row in counts["rows"]:
        out.append(f"| {row['length']:,} | {row['nocache_per_token']:,} | {row['cached_per_token']:,} | "
                   f"{row['nocache_total']:,} | {row['cached_total']:,} | {row['total_ratio']:.1f}× |")
    last = counts["rows"][-1]
    out += ["", f"The split of token n = {last['length']:,}: without the cache, projections "
            f"{last['nocache_projection_per_token']:,} + attention {last['nocache_attention_per_token']:,}; "
            f"with it, projections {last['cached_projection_per_token']:,} (3d², the same for every token) "
            f"+ attention {last['cached_attention_per_token']:,} (2·n·d, still growing). The cache removes "
            "the recomputation of past keys and values, not attention over them.", ""]
    return out


def _latency(report: dict, plots: dict) -> list[str]:
    latency = report["latency"]
    model = report["model_config"]
    out = ["## 2. The same shape, measured: decode-step latency", "",
           *_image(plots, "latency", "decode step latency vs context length, cached and uncached"),
           f"{model['name']} ({model['parameters']:,} parameters, {model['layers']} layers, hidden "
           f"{model['hidden_size']}, {model['heads']} heads / {model['kv_heads']} kv heads), "
           f"{latency['dtype'].removeprefix('torch.')}, {latency['threads']} torch thread(s), "
           f"backend `{latency['backend']}` (the model's forward). "
           "A cached step runs one new token against a cache of "
           "L − 1 tokens; an uncached step recomputes all L positions. "
           f"Milliseconds, median (min–max) of {latency['repeats']} repeats, the two paths alternating; "
           "wall time on a machine that may be shared (see section 6 for its load).", "",
           "| context L | cached step, ms | no-cache step, ms | no-cache / cached |", "|---:|---:|---:|---:|"]
    for row in latency["rows"]:
        out.append(f"| {row['context']:,} | {_spread(row['cached_ms'])} | {_spread(row['uncached_ms'])} | "
                   f"{row['speedup']:.1f}× |")
    if latency["skipped_lengths"]:
        out += ["", f"Skipped (past the model's {model['max_position_embeddings']:,} positions): "
                f"{', '.join(map(str, latency['skipped_lengths']))}."]
    first, last = latency["rows"][0], latency["rows"][-1]
    growth = {key: last[key]["median"] / first[key]["median"] for key in ("cached_ms", "uncached_ms")}
    span = last["context"] / first["context"]
    out += ["", f"From L = {first['context']:,} to {last['context']:,} ({span:g}× the context) the "
            f"cached step's median goes from {first['cached_ms']['median']:.3g} to "
            f"{last['cached_ms']['median']:.3g} ms (×{growth['cached_ms']:.2g}) and the uncached one from "
            f"{first['uncached_ms']['median']:.3g} to {last['uncached_ms']['median']:.3g} ms "
            f"(×{growth['uncached_ms']:.2g}). A cached step reads every weight once whatever L is, and only "
            "its attention grows with L; the uncached step redoes every position's projections, as the "
            "counts of section 1 say.", ""]
    return out


def _equality(report: dict, plots: dict) -> list[str]:
    eq = report["equality"]
    tol = eq["tolerance"]
    out = ["## 3. Equality: every exact cache kind against recomputation", "",
           *_image(plots, "equality", "max |Δlogit| per cache kind against the tolerance"),
           f"Each kind decodes {eq['new_tokens']} greedy tokens after a {eq['prompt_tokens']}-token prompt; "
           "its logits at every step are compared with one forward of the same sequence without a "
           "cache. The windowed kinds run the model with every layer windowed (the reference windows "
           f"its masks the same way). Tolerance per logit: |Δ| ≤ {tol['atol']:g} + "
           f"{tol['rtol']:g}·max|logit| of its step "
           f"({eq['dtype'].removeprefix('torch.')}).", "",
           "| cache kind | storage | max \\|Δlogit\\| | max \\|logit\\| | same argmax every step | within |",
           "|---|---|---:|---:|:---:|:---:|"]
    for row in eq["rows"]:
        if "skipped" in row:
            out.append(f"| {row['kind']} | {row['storage']} | skipped: {row['skipped']} | | | |")
            continue
        out.append(f"| {row['kind']} | {row['storage']} | {row['max_abs_logit_diff']:.3g} | "
                   f"{row['max_abs_logit']:.3g} | {_yes(row['same_argmax'])} | {_yes(row['within'])} |")
    return out + [""]


def _drift(report: dict, plots: dict) -> list[str]:
    ref, engine = report["drift"]["reference"], report["drift"]["engine"]
    tol = ref["tolerance"]
    out = ["## 4. Low precision: drift vs bits", "",
           *_image(plots, "drift", "drift vs bits in the reference and in the engine"),
           f"**Reference.** The single head (d = {ref['d']}, {ref['tokens']} tokens) writes k and v into "
           "its cache rounded to b significant bits (`generate_cached(store=...)`); outputs against the "
           f"exact ones, tolerance |a − b| ≤ {tol['atol']:g} + {tol['rtol']:g}·|b| (the lab's). For "
           "comparison: " + ", ".join(f"{name} keeps {b}" for name, b in ref["format_bits"].items()) + ".",
           "", "| bits kept | max \\|Δoutput\\| | within |", "|---:|---:|:---:|"]
    for row in ref["rows"]:
        out.append(f"| {row['bits']} | {row['max_abs_diff']:.3g} | {_yes(row['within'])} |")
    within = [row["bits"] for row in ref["rows"] if row["within"]]
    out += ["", "The fewest bits within the lab's float64 tolerance: "
            + (f"{min(within)}." if within else "none of those tried.")
            + " Each float format above, fp32 included, keeps fewer bits and moves the output by more: "
            "low precision trades accuracy for bytes and is measured against a tolerance of its own, "
            "as below."]
    etol = engine["tolerance"]
    prompt_tokens = ", ".join(map(str, engine["prompt_tokens"]))
    out += ["", f"**Engine.** `kvcache.report.drift.measure_drift` on the model: {engine['prompts']} "
            f"prompt(s) "
            f"({prompt_tokens} tokens), {engine['tokens']} greedy tokens each, quantized cache against "
            f"the unquantized one. Within tolerance = greedy agreement ≥ {etol['greedy_agreement']:g} "
            f"(free-running and teacher-forced) and mean KL ≤ {etol['mean_kl']:g} nats.", "",
            "| cache | group / residual | max \\|Δlogit\\| | mean KL (nats) | greedy agreement | "
            "teacher-forced agreement | first differing token per prompt | quantized share | "
            "bytes/token (vs unquantized) | within |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|:---:|"]
    for row in sorted(engine["rows"], key=lambda r: (r["bits"], r["kind"])):
        ratio = row["reference_bytes_per_token"] / row["bytes_per_token"]
        out.append(f"| {row['name']} | {row['group_size']} / {row['residual_length']} | "
                   f"{row['max_abs_logit_diff']:.3g} | {row['mean_kl']:.3g} | "
                   f"{row['greedy_agreement']:.4f} | {row['teacher_forced_agreement']:.4f} | "
                   f"{', '.join('—' if t is None else str(t) for t in row['first_divergence'])} | "
                   f"{row['quantized_fraction']:.0%} | "
                   f"{row['bytes_per_token']:.0f} ({ratio:.2f}× smaller) | {_drift_verdict(row)} |")
    return out + [""]


def _drift_verdict(row: dict) -> str:
    """yes / NO, or that nothing was quantized (every token stayed in the residual or a ring):
    such a row measured nothing and does not pass."""
    if not row["quantized_fraction"]:
        return "**nothing quantized**"
    return _yes(row["within_tolerance"])


def _memory(report: dict, plots: dict) -> list[str]:
    memory = report["memory"]
    dtypes = memory["dtypes"]
    budget = format_bytes(memory["budget_bytes"])
    out = ["## 5. Memory: bytes vs context, and capacity", "",
           *_image(plots, "memory", "KV bytes vs context per model, and sequences that fit in the budget"),
           "2 × layers × kv heads × tokens × head dim × bytes per element (`kvcache.memory`), batch 1; "
           "a windowed layer holds at most its window. int8/fp8 and int4 are the bare element sizes: a "
           "quantized cache adds its scales (and keeps a full-precision residual), see docs/quantized.md. "
           "The public architectures are given by the fields of their published Hugging Face config.json "
           "(repositories below), read by `KVShape.from_config` as any config would be; head dim = "
           "hidden_size / num_attention_heads.", "",
           "| model | layers / kv heads / head dim | window | numbers from | " +
           " | ".join(f"per token, {d}" for d in dtypes) + " |",
           "|---|---|---:|---|" + "---:|" * len(dtypes)]
    for m in memory["models"]:
        out.append(f"| {m['name']} | {m['layers']} / {m['kv_heads']} / {m['head_dim']} | "
                   f"{m['sliding_window'] or '—'} | {m['source']} | " +
                   " | ".join(format_bytes(m["bytes_per_token"][d]) for d in dtypes) + " |")
    shown = [t for t in memory["lengths"] if t in (4096, 32768, 131072)] or memory["lengths"][-1:]
    out += ["", "| model | " + " | ".join(f"{t:,} tokens, {d}" for t in shown for d in dtypes[:2]) + " |",
            "|---|" + "---:|" * (len(shown) * len(dtypes[:2]))]
    for m in memory["models"]:
        by_tokens = {r["tokens"]: r for r in m["rows"]}
        out.append(f"| {m['name']} | " +
                   " | ".join(format_bytes(by_tokens[t][d]) for t in shown for d in dtypes[:2]) + " |")
    out += ["", f"Capacity in a KV budget of {budget}: longest context of one sequence / sequences of "
            f"{memory['capacity_tokens']:,} tokens (the KV cache only: weights and activations need their "
            "own memory; a model's position limit is not applied).", "",
            "| model | " + " | ".join(dtypes) + " |", "|---|" + "---:|" * len(dtypes)]
    for m in memory["models"]:
        cells = []
        for d in dtypes:
            cap = m["capacity"][d]
            longest = cap["max_tokens_batch_1"]
            longest = "unbounded (window)" if longest is None else f"{longest:,}"
            cells.append(f"{longest} / {cap['max_sequences']:,}")
        out.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    return out + [""]


def _machine(report: dict) -> list[str]:
    machine = report["machine"]
    settings = report["settings"]
    labels = [("utc", "finished (UTC)"), ("platform", "platform"), ("cpu", "CPU"), ("cpu_count", "CPUs"),
              ("cpus_usable", "CPUs usable by this process"),
              ("load_average_before", "load average before (1/5/15 min)"),
              ("load_average_1_5_15", "load average after (1/5/15 min)"), ("python", "Python"),
              ("torch", "torch"), ("torch_threads", "torch threads"), ("torch_mkl", "torch MKL"),
              ("numpy", "numpy"), ("matplotlib", "matplotlib"), ("kvcache", "kvcache")]
    out = ["## 6. Machine and versions", "", "| | |", "|---|---|"]
    for key, label in labels:
        if key in machine:
            value = machine[key]
            if isinstance(value, list):
                value = " / ".join(f"{v:g}" for v in value)
            out.append(f"| {label} | {value} |")
    out += [f"| model folder | {report['model_config']['name']} |",
            f"| run | {'--quick' if settings['quick'] else 'full'}, {report['elapsed_s']:.0f} s |", ""]
    return out


def report_markdown(report: dict, plots: dict[str, str]) -> str:
    """The whole report as Markdown; `plots` maps a section to its PNG file name (beside report.md)."""
    quick = " --quick" if report["settings"]["quick"] else ""
    out = ["# kvcache report", "",
           f"Produced by `kvcache report{quick}` on this machine (section 6); every figure is in "
           "`report.json` beside this file. Sections 1, 4 (reference) and 5 are counted and the same on "
           "any machine; sections 3 and 4 (engine) are computed on the model; section 2 is measured, with "
           "its spread.", ""]
    out += _counts(report, plots) + _latency(report, plots) + _equality(report, plots)
    out += _drift(report, plots) + _memory(report, plots) + _machine(report)
    return "\n".join(out)
