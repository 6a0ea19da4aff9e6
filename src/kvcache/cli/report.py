"""`kvcache report`: counted and measured figures in one document, with plots.

    kvcache report                       # the default model, into ./report (a few minutes)
    kvcache report --quick --out /tmp/r  # the same figures on smaller ranges (well under a minute)

Writes report.md, report.json and five PNGs; a progress bar on stderr while it runs, the files
and the headline figures on stdout at the end. Exit status 1 when an exact cache kind is not
within tolerance; a lossy one's drift is measured, not failed. torch and matplotlib are imported
inside `run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcache.cli._args import positive_int, size_argument
from kvcache.memory import format_bytes
from kvcache.report.progress import ProgressBar


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model",
                        help="local checkpoint folder (config.json, safetensors), GGUF file or a model name "
                        "such as smollm2, as every command takes it; default: the bundled default model")
    parser.add_argument("--out", default="report", help="folder to write into (default ./report)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller ranges and fewer repeats: well under a minute")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch CPU threads while measuring (default 1: a decode step of a small model "
                             "is small work, and one thread gives the steadiest figures on a shared machine)")
    parser.add_argument("--budget", type=size_argument, default=24 * 2**30,
                        help="KV memory budget for the capacity figures (default 24GiB)")


def _headline(report: dict) -> list[str]:
    counts = report["counts"]["rows"][-1]
    latency = report["latency"]["rows"]
    equality = [row for row in report["equality"]["rows"] if "skipped" not in row]
    engine = sorted(report["drift"]["engine"]["rows"], key=lambda r: (r["bits"], r["kind"]))
    memory = report["memory"]
    lines = [
        f"counts: n={counts['length']}: {counts['nocache_total']:,} multiplications without a cache, "
        f"{counts['cached_total']:,} with ({counts['total_ratio']:.1f}x); closed forms match: "
        f"{report['counts']['matches_closed_forms']}",
        f"latency: context {latency[-1]['context']}: cached {latency[-1]['cached_ms']['median']:.3g} ms, "
        f"no cache {latency[-1]['uncached_ms']['median']:.3g} ms ({latency[-1]['speedup']:.1f}x)",
        "equality: " + ", ".join(f"{r['kind']} {r['max_abs_logit_diff']:.2g}" for r in equality)
        + f" (all within tolerance: {all(r['within'] for r in equality)})",
        "drift: " + ", ".join(f"{r['name']} KL {r['mean_kl']:.2g} agreement {r['greedy_agreement']:.4f}"
                              for r in engine),
    ]
    budget = format_bytes(memory["budget_bytes"])
    per_model = [f"{m['name']} {m['capacity']['bfloat16']['max_sequences']}" for m in memory["models"]
                 if "bfloat16" in m["capacity"]]
    if per_model:
        lines.append(f"memory: sequences of {memory['capacity_tokens']:,} tokens in {budget} (bf16): "
                     + ", ".join(per_model))
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("kvcache report: error: matplotlib is needed for the plots: pip install 'kvcache[report]'",
              file=sys.stderr)
        return 2
    import torch

    from kvcache.defaults import resolve_model_dir
    from kvcache.report import write_report

    try:  # what every command's -m takes; a wrong one said before anything is measured
        model = resolve_model_dir(args.model)
    except ValueError as error:
        print(f"kvcache report: error: -m {args.model}: {error}", file=sys.stderr)
        return 2
    if not Path(model).exists():
        print(f"kvcache report: error: -m {args.model}: no such file or folder (expected a checkpoint "
              "folder, a GGUF file or a model name such as smollm2)", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = write_report(args.out, args.model, quick=args.quick, progress=ProgressBar("kvcache report"),
                              budget_bytes=args.budget)
    except (ValueError, OSError) as error:
        print(f"kvcache report: error: {error}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    names = ["report.md", "report.json", *report["plots"].values()]
    print(f"kvcache report: wrote {', '.join(names)} in {out} ({report['elapsed_s']:.0f} s)")
    for line in _headline(report):
        print(f"  {line}")
    return _status(report)


def _status(report: dict) -> int:
    """1 when an exact cache kind is not within tolerance (the record is written; the run says
    so): a wrong answer. A lossy cache past its drift tolerance is a measurement the report
    shows, said on stderr, and leaves the status 0 (the default run finds int4 and fp8 past it)."""
    drifting = [f"drift {row['name']}" + ("" if row["quantized_fraction"] else " (nothing quantized)")
                for row in report["drift"]["engine"]["rows"] if not row["within_tolerance"]]
    if drifting:
        print(f"kvcache report: lossy caches past their drift tolerance (measured, shown in report.md "
              f"section 4; not a failure): {', '.join(drifting)}", file=sys.stderr)
    failing = [f"equality {row['kind']}" for row in report["equality"]["rows"]
               if "skipped" not in row and not row["within"]]
    if failing:
        print(f"kvcache report: exact caches not within tolerance: {', '.join(failing)}", file=sys.stderr)
        return 1
    return 0
