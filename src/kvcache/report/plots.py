"""The report's PNG plots, drawn with matplotlib's Agg canvas (no pyplot, no global backend).

`draw_plots(report, folder)` writes one PNG per section and returns {section: file name}.
Counts, latency and memory use log scales; zero differences are drawn at a floor and labelled.
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

DPI = 100
CACHED, UNCACHED = "#1f77b4", "#d62728"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def _figure(panels: int, height: float = 4.0) -> tuple[Figure, list]:
    figure = Figure(figsize=(4.6 * panels, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    return figure, list(axes)


def _save(figure: Figure, folder: Path, name: str) -> str:
    """Write the figure as a 256-colour PNG (a third of the RGBA file, the same to the eye)."""
    from PIL import Image  # a dependency of matplotlib

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(folder / name, optimize=True)
    return name


def _plain_log_y(ax) -> None:
    """Ticks of a log y axis at 1, 2, 5 × 10^k, labelled as plain numbers (0.5, 2, 50)."""
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _tokens_axis(ax, label: str = "context length (tokens)") -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)


def plot_counts(counts: dict, folder: Path) -> str:
    rows, forms, d = counts["rows"], counts["closed_forms"], counts["d"]
    n = [r["length"] for r in rows]
    figure, (step, total, split) = _figure(3)
    for ax, key, title in ((step, "per_token", "one step: the multiplications of token n"),
                           (total, "total", "all n tokens: cumulative multiplications")):
        for path, color, label in (("nocache", UNCACHED, "no cache"), ("cached", CACHED, "KV cache")):
            ax.plot(n, [f[f"{path}_{key}"] for f in forms], "-", color=color, alpha=0.6,
                    label=f"{label}: closed form")
            ax.plot(n, [r[f"{path}_{key}"] for r in rows], "o", color=color, markersize=5,
                    label=f"{label}: counted")
        _tokens_axis(ax)
        ax.set_yscale("log")
        ax.set_ylabel("multiplications (log)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    split.plot(n, [r["nocache_projection_per_token"] for r in rows], "o-", color=UNCACHED,
               label="no cache: projections 3·n·d² (grow)")
    split.plot(n, [r["cached_projection_per_token"] for r in rows], "o-", color=CACHED,
               label="cache: projections 3·d² (constant)")
    split.plot(n, [r["cached_attention_per_token"] for r in rows], "s:", color="#9467bd",
               label="both: attention 2·n·d (grows)")
    _tokens_axis(split)
    split.set_yscale("log")
    split.set_ylabel("multiplications of token n (log)")
    split.set_title("what the cache makes constant, what still grows", fontsize=10)
    split.legend(fontsize=8)
    figure.suptitle(f"Counted multiplications, one attention head, d = {d} (kvcache.reference)", fontsize=11)
    return _save(figure, folder, "counts.png")


def plot_latency(latency: dict, model_name: str, folder: Path) -> str:
    rows = latency["rows"]
    n = [r["context"] for r in rows]
    figure, (times, ratio) = _figure(2)
    for key, color, label in (("uncached_ms", UNCACHED, "no cache: recompute all positions"),
                              ("cached_ms", CACHED, "KV cache: one new position")):
        median = [r[key]["median"] for r in rows]
        low = [m - r[key]["min"] for m, r in zip(median, rows)]
        high = [r[key]["max"] - m for m, r in zip(median, rows)]
        times.errorbar(n, median, yerr=[low, high], fmt="o-", color=color, capsize=3,
                       label=f"{label} (median, bars min–max)")
    _tokens_axis(times)
    times.set_yscale("log")
    _plain_log_y(times)
    times.set_ylim(top=max(r["uncached_ms"]["max"] for r in rows) * 5)  # room for the legend
    times.set_ylabel("one decode step (ms, log)")
    times.set_title(f"decode step latency, {latency['repeats']} repeats per point", fontsize=10)
    times.legend(fontsize=8, loc="upper left")
    ratio.plot(n, [r["speedup"] for r in rows], "o-", color="#2ca02c")
    ratio.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1× (no gain)")
    _tokens_axis(ratio)
    ratio.set_yscale("log")
    _plain_log_y(ratio)
    ratio.set_ylabel("no-cache step / cached step (median ratio, log)")
    ratio.set_title("speed-up of a cached step", fontsize=10)
    ratio.legend(fontsize=8)
    figure.suptitle(f"Measured on {model_name}: {latency['dtype'].removeprefix('torch.')}, "
                    f"{latency['threads']} torch thread(s)", fontsize=11)
    return _save(figure, folder, "latency.png")


def _floor(values: list[float], floor: float) -> list[float]:
    return [v if v > 0 else floor for v in values]


def plot_equality(equality: dict, folder: Path) -> str:
    rows = [row for row in equality["rows"] if "skipped" not in row]
    tol = equality["tolerance"]
    figure, (ax,) = _figure(1, height=3.4)
    figure.set_figwidth(9.0)
    names = [r["kind"] + (f" (window {r['window']})" if r["window"] else "") for r in rows]
    diffs = [r["max_abs_logit_diff"] for r in rows]
    floor = tol["atol"] / 1e3
    largest = max(r["max_abs_logit"] for r in rows)
    ax.axvspan(tol["atol"], tol["atol"] + tol["rtol"] * largest, color="grey", alpha=0.15,
               label=f"tolerance {tol['atol']:g} + {tol['rtol']:g}·|logit|:\nfrom |logit| = 0 to the "
                     f"largest ({largest:.3g})")
    ax.axvline(tol["atol"], color="black", linestyle="--", linewidth=1)
    bars = ax.barh(names, _floor(diffs, floor), color=[CACHED if r["within"] else UNCACHED for r in rows])
    for bar, row in zip(bars, rows):
        value = row["max_abs_logit_diff"]
        text = f"{value:.2g}" if value > 0 else "0 (bit-identical)"
        used = f"  {row['tolerance_used']:.0%} of its tolerance" if "tolerance_used" in row else ""
        ax.text(bar.get_width() / 1.3, bar.get_y() + bar.get_height() / 2, text + " ", va="center",
                ha="right", fontsize=8, color="white")
        ax.text(tol["atol"] + tol["rtol"] * largest, bar.get_y() + bar.get_height() / 2, used,
                va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, (tol["atol"] + tol["rtol"] * largest) * 300)
    ax.invert_yaxis()
    ax.set_xlabel("max |Δlogit|, cached vs recomputed without a cache (log)")
    ax.set_title(f"Exact caches: {equality['prompt_tokens']}-token prompt + {equality['new_tokens']} "
                 f"greedy tokens, {equality['dtype'].removeprefix('torch.')}", fontsize=10)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, -0.42), ncol=1, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(figure, folder, "equality.png")


def plot_drift(drift: dict, folder: Path) -> str:
    """drift.png: the reference's error against bits kept, the engine's KL and token agreement
    per quantized cache setting, each against its tolerance."""
    ref, engine = drift["reference"], drift["engine"]
    figure, (bits_ax, kl_ax, agree_ax) = _figure(3)
    _drift_vs_bits(bits_ax, ref)
    settings = sorted(engine["rows"], key=lambda r: (r["bits"], r["kind"]))
    names = [f"{r['name']}\n({r['bits']} bits)" for r in settings]
    _drift_kl(kl_ax, engine, settings, names)
    _drift_agreement(agree_ax, engine["tolerance"], settings, names)
    figure.suptitle("Low precision: drift vs bits, against tolerance", fontsize=11)
    return _save(figure, folder, "drift.png")


def _drift_vs_bits(bits_ax, ref: dict) -> None:
    """The reference head's max |Δoutput| against significant bits kept, formats marked."""
    rows = ref["rows"]
    bits = [r["bits"] for r in rows]
    diffs = [r["max_abs_diff"] for r in rows]
    floor = ref["tolerance"]["atol"] / 100
    bits_ax.plot(bits, _floor(diffs, floor), "-", color="grey", alpha=0.6)
    inside = [(b, d) for b, d, r in zip(bits, _floor(diffs, floor), rows) if r["within"]]
    outside = [(b, d) for b, d, r in zip(bits, _floor(diffs, floor), rows) if not r["within"]]
    if outside:
        bits_ax.plot(*zip(*outside), "o", color=UNCACHED, label="outside tolerance")
    if inside:
        bits_ax.plot(*zip(*inside), "o", color=CACHED, label="within tolerance")
    bits_ax.axhline(ref["tolerance"]["rtol"], color="black", linestyle="--", linewidth=1,
                    label=f"tolerance ≈ {ref['tolerance']['rtol']:g}·|output|")
    for index, (name, b) in enumerate(ref["format_bits"].items()):
        bits_ax.axvline(b, color=PALETTE[index + 2], linestyle=":", linewidth=1)
        bits_ax.text(b, 0.03, f" {name} ({b})", transform=bits_ax.get_xaxis_transform(), rotation=90,
                     va="bottom", ha="right", fontsize=7, color=PALETTE[index + 2])
    bits_ax.set_yscale("log")
    bits_ax.set_xlabel("significant bits kept in the cached k, v")
    bits_ax.set_ylabel("max |Δoutput| vs exact (log)")
    bits_ax.set_title(f"reference: one head d={ref['d']}, {ref['tokens']} tokens", fontsize=10)
    bits_ax.legend(fontsize=8, loc="upper right")
    bits_ax.grid(True, alpha=0.3)


def _drift_kl(kl_ax, engine: dict, settings: list[dict], names: list[str]) -> None:
    """The engine's mean KL per setting against its tolerance."""
    tol = engine["tolerance"]
    kl = [r["mean_kl"] for r in settings]
    bars = kl_ax.bar(names, _floor(kl, tol["mean_kl"] / 1e6),
                     color=[CACHED if r["within_tolerance"] else UNCACHED for r in settings])
    for bar, r in zip(bars, settings):
        kl_ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 1.3,
                   f"KL {r['mean_kl']:.2g}\n|Δlogit| ≤ {r['max_abs_logit_diff']:.2g}",
                   ha="center", va="bottom", fontsize=7)
    kl_ax.axhline(tol["mean_kl"], color="black", linestyle="--", linewidth=1,
                  label=f"tolerance: mean KL ≤ {tol['mean_kl']:g}")
    kl_ax.legend(handles=[*kl_ax.get_legend_handles_labels()[0],
                          Patch(color=CACHED, label="within tolerance (KL and agreement)"),
                          Patch(color=UNCACHED, label="outside it (some criterion)")],
                 fontsize=7, loc="upper right")
    kl_ax.set_yscale("log")
    kl_ax.set_ylim(top=max(tol["mean_kl"], *kl) * 1000)
    kl_ax.set_ylabel("mean KL(unquantized ‖ quantized), nats (log)")
    kl_ax.set_title(f"engine: quantized cache, {engine['prompts']} prompt(s) × {engine['tokens']} tokens",
                    fontsize=10)
    kl_ax.set_xlabel("cache setting (bits per stored k, v element)")


def _drift_agreement(agree_ax, tol: dict, settings: list[dict], names: list[str]) -> None:
    """Greedy free-running and teacher-forced argmax agreement per setting."""
    width = 0.38
    positions = range(len(settings))
    agree_ax.bar([p - width / 2 for p in positions], [r["greedy_agreement"] for r in settings], width,
                 label="greedy, free-running", color=CACHED)
    agree_ax.bar([p + width / 2 for p in positions], [r["teacher_forced_agreement"] for r in settings],
                 width, label="argmax, teacher-forced", color="#9467bd")
    agree_ax.axhline(tol["greedy_agreement"], color="black", linestyle="--", linewidth=1,
                     label=f"tolerance: ≥ {tol['greedy_agreement']:g}")
    agree_ax.set_xticks(list(positions), names)
    agree_ax.set_ylim(min(0.9, *(r["greedy_agreement"] for r in settings)) - 0.02, 1.01)
    agree_ax.set_ylabel("fraction of tokens equal to the unquantized run")
    agree_ax.set_xlabel("cache setting (bits per stored k, v element)")
    agree_ax.set_title("token agreement", fontsize=10)
    agree_ax.legend(fontsize=8, loc="lower right")


def _short(count: float) -> str:
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if count >= size:
            return f"{count / size:g} {unit}B"
    return f"{count:g} B"


def plot_memory(memory: dict, folder: Path) -> str:
    models = memory["models"]
    lengths = memory["lengths"]
    dtype = "bfloat16" if "bfloat16" in memory["dtypes"] else memory["dtypes"][0]
    figure, (bytes_ax, cap_ax) = _figure(2, height=4.4)
    for index, model in enumerate(models):
        window = f", window {model['sliding_window']:,}" if model["sliding_window"] else ""
        shape = f"{model['layers']}/{model['kv_heads']}/{model['head_dim']}{window}"
        bytes_ax.plot(lengths, [r[dtype] for r in model["rows"]], "o-", markersize=3, color=PALETTE[index],
                      label=f"{model['name']} ({shape})")
    bytes_ax.axhline(memory["budget_bytes"], color="black", linestyle="--", linewidth=1,
                     label=f"budget {_short(memory['budget_bytes'])}")
    _tokens_axis(bytes_ax, "context length (tokens, batch 1)")
    bytes_ax.set_yscale("log", base=2)
    bytes_ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _short(y)))
    bytes_ax.set_ylabel(f"KV cache bytes in {dtype} (log)")
    bytes_ax.set_title(f"bytes vs context, {dtype} (float32 ×2, 8-bit ×½, int4 ×¼)", fontsize=10)
    bytes_ax.legend(fontsize=7, title="layers / kv heads / head dim", title_fontsize=7)

    dtypes = memory["dtypes"]
    width = 0.8 / len(dtypes)
    for d_index, name in enumerate(dtypes):
        xs = [m_index + (d_index - (len(dtypes) - 1) / 2) * width for m_index in range(len(models))]
        values = [m["capacity"][name]["max_sequences"] for m in models]
        cap_ax.bar(xs, [max(v, 0.5) for v in values], width, label=name, color=PALETTE[d_index])
    cap_ax.set_xticks(range(len(models)), [m["name"] for m in models], rotation=15, fontsize=8)
    cap_ax.set_yscale("log")
    cap_ax.set_ylabel(f"sequences of {memory['capacity_tokens']:,} tokens that fit (log)")
    cap_ax.set_title(f"capacity in a {_short(memory['budget_bytes'])} KV budget", fontsize=10)
    cap_ax.legend(fontsize=8, title="cache dtype", title_fontsize=8)
    cap_ax.grid(True, axis="y", alpha=0.3)
    figure.suptitle("KV-cache memory: 2 × layers × kv heads × tokens × head dim × bytes", fontsize=11)
    return _save(figure, folder, "memory.png")


def draw_plots(report: dict, folder: str | Path) -> dict[str, str]:
    """Write counts.png, latency.png, equality.png, drift.png and memory.png into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = report.get("model_config", {}).get("name", "the model")
    return {
        "counts": plot_counts(report["counts"], folder),
        "latency": plot_latency(report["latency"], name, folder),
        "equality": plot_equality(report["equality"], folder),
        "drift": plot_drift(report["drift"], folder),
        "memory": plot_memory(report["memory"], folder),
    }
