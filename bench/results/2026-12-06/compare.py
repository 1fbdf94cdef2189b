"""The before/after table of this folder: each CPU benchmark's headline figures in its committed
results file (before: the scripts as they were) against this folder's re-run through
``python -m bench NAME`` (after). Writes compare.json (the result schema, name "rerun") and prints
the table as Markdown. From the repository root::

    PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-06/compare.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent


def metrics(path: Path) -> dict:
    """A results file's measurements: the ``metrics`` of a schema file, the whole of an older one."""
    doc = json.loads(path.read_text())
    return doc["metrics"] if isinstance(doc.get("metrics"), dict) else doc


def spread(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})"


def num(x, fmt=".3g") -> str:
    return "-" if x is None else format(x, fmt)


def keep(m: dict) -> dict:
    return next(a for a in m["arms"] if a["mode"] == "keep")


def spare_max(m: dict) -> float | None:
    got = [m[k]["max"] for k in ("spare_actor_healthy_s", "spare_engine_healthy_s") if m.get(k)]
    return max(got) if got else None


def launches(m) -> str:
    rows = m["launches"] if isinstance(m, dict) else m
    return ", ".join(f"{r['method']} {r['launch_s']:.1f} s" for r in rows)


# (benchmark, figure, target, before file (under bench/results), reader -> text); the reader is
# applied to both files' measurements. The after file is <benchmark>.json here
# (fleet_overhead_pipeline: fleet_overhead's pipeline arms, run on their own).
FIGURES = [
    ("control_plane", "tick at 10,000 shards, median CPU ms", "< 10", "2026-12-01/cpu-quiet-control_plane.json",
     lambda m: num(m["rows"][-1]["tick_median_ms"])),
    ("control_plane", "routing at 10,000 shards, median CPU us", "< 20", "2026-12-01/cpu-quiet-control_plane.json",
     lambda m: num(m["rows"][-1]["route_median_us"])),
    ("refit_call", "Ray / direct line, refit call wall", "> 1", "2026-12-03/cpu-refit_call.json",
     lambda m: num(m["ray_over_direct"]["wall_s"])),
    ("refit_call", "ms saved per refit by the direct line", "", "2026-12-03/cpu-refit_call.json",
     lambda m: num(m["saved_ms"])),
    ("fleet_overhead", "fleet / direct tokens/s", ">= 0.95", "2026-12-01/cpu-quiet-fleet_overhead-after-503fix.json",
     lambda m: spread(m["fleet"]["ratio"])),
    ("fleet_overhead_pipeline", "Prefect / plain pipeline wall", "<= 1.10",
     "2026-12-01/cpu-quiet-fleet_overhead-after-503fix.json", lambda m: spread((m.get("pipeline") or {}).get("ratio"))),
    ("serve", "HTTP / library tokens/s", ">= 0.9", "2026-12-01/cpu-serve-run1.json", lambda m: spread(m["ratio"])),
    ("sessions", "prefix-cache hit rate, affinity / none", "> 1", "2026-12-01/cpu-sessions.json",
     lambda m: num(m["hit_rate_ratio"])),
    ("sessions", "TTFT p50, none / affinity", "> 1", "2026-12-01/cpu-sessions.json", lambda m: num(m["ttft_p50_ratio"])),
    ("recovery", "SIGKILL -> monitor, max s", "<= 1", "2026-12-01/cpu-quiet-recovery.json",
     lambda m: num(m["detect_all_s"]["max"])),
    ("recovery", "SIGKILL -> healthy with a spare, max s", "<= 2", "2026-12-01/cpu-quiet-recovery.json",
     lambda m: num(spare_max(m))),
    ("recovery", "no spare / cold start", "<= 1.2", "2026-12-01/cpu-quiet-recovery.json",
     lambda m: spread(m["nospare_over_cold"])),
    ("step_loop", "batch step loop / LLM.generate", "<= 1.05", "2026-12-01/cpu-step_loop.json",
     lambda m: num(m["over_llm_generate"]["step_loop"])),
    ("front_end", "front-end work, shard actor / plain process (proc_s)", "near 1", "2026-12-02/cpu-front_end.json",
     lambda m: num(m["median"]["actor"]["proc_s"] / m["median"]["plain"]["proc_s"])),
    ("front_end", "GC share of a batch, actor / plain", "", "2026-12-02/cpu-front_end.json",
     lambda m: "{:.1%} / {:.1%}".format(*(m["median"][a]["gc_s"] / m["median"][a]["wall_s"] for a in ("actor", "plain")))),
    ("refit", "refit from a checkpoint, s (443 MB, 2 shards)", "", "2026-12-01/cpu-quiet-refit.json",
     lambda m: num(m["refit_checkpoint_s"])),
    ("refit", "refit vs engine restart", ">= 20x", "2026-12-01/cpu-quiet-refit.json",
     lambda m: num(m.get("speedup_vs_restart"), ".0f")),
    ("refit", "checkpoint refit, fraction of copy bandwidth", ">= 0.5", "2026-12-01/cpu-quiet-refit.json",
     lambda m: num(m["checkpoint_fraction_of_copy"])),
    ("refit_inflight", "keep: tokens/s with refits / without", ">= 0.9", "2026-12-01/cpu-quiet-refit_inflight.json",
     lambda m: num(keep(m)["throughput_vs_no_refit"])),
    ("refit_inflight", "keep: longest stall / idle refit", "", "2026-12-01/cpu-quiet-refit_inflight.json",
     lambda m: num(keep(m)["stall_vs_idle_refit"])),
    ("overload", "goodput at 4x capacity / unloaded", ">= 0.9", "2026-12-04/cpu-overload.json",
     lambda m: num(m["overload"]["goodput_ratio"])),
    ("overload", "/health p99 under overload, ms", "< 100", "2026-12-04/cpu-overload.json",
     lambda m: num(m["overload"]["health_p99_s"] * 1e3)),
    ("overload", "requests hung or lost under overload", "0", "2026-12-04/cpu-overload.json",
     lambda m: str(m["overload"]["hung"] + m["overload"]["lost"])),
    ("rl_step", "GRPO async / sync steps per second", "> 1", "2026-12-04/rl_step-cpu.json",
     lambda m: num((m.get("ratios") or {}).get("async_over_sync_steps_per_s"))),
]


def verdicts_of(path: Path) -> str:
    doc = json.loads(path.read_text())
    v = doc.get("verdicts") or {}
    ok = [x in (True, "PASS") for x in v.values()]
    return f"{sum(ok)} of {len(ok)} PASS" if ok else "-"


def ab_rows() -> list[dict]:
    """The A/B runs here (ab-NAME-N-ARM.json, ab.sh): each figure of NAME, run by run."""
    out = []
    for name in sorted({p.name.split("-")[1] for p in HERE.glob("ab-*-*-*.json")}):
        runs = sorted(HERE.glob(f"ab-{name}-*-*.json"), key=lambda p: int(p.stem.split("-")[2]))
        for bench, figure, _target, _before, read in FIGURES:
            if bench != name:
                continue
            got = []
            for path in runs:
                try:
                    got.append((path.stem.split("-")[3], read(metrics(path))))
                except (KeyError, TypeError, ZeroDivisionError, StopIteration) as exc:
                    got.append((path.stem.split("-")[3], f"({type(exc).__name__})"))
            out.append({"benchmark": name, "figure": figure, "runs": got})
    return out


def main() -> int:
    from bench.lib.result import write_result

    rows = []
    for name, figure, target, before_file, read in FIGURES:
        after_file = HERE / f"{name}.json"
        row = {"benchmark": name, "figure": figure, "target": target, "before_file": before_file,
               "before": read(metrics(RESULTS / before_file))}
        try:
            row["after"] = read(metrics(after_file))
        except (OSError, KeyError, TypeError, ZeroDivisionError, StopIteration) as exc:
            row["after"] = "not re-run" if isinstance(exc, OSError) else f"({type(exc).__name__})"
        rows.append(row)
    rows.append({"benchmark": "crash_resume", "figure": "correctness verdicts", "target": "all PASS",
                 "before_file": "2026-12-04/cpu-crash_resume.json",
                 "before": verdicts_of(RESULTS / "2026-12-04/cpu-crash_resume.json"),
                 "after": verdicts_of(HERE / "crash_resume.json") if (HERE / "crash_resume.json").exists() else "not re-run"})
    if (HERE / "engine_start.json").exists():
        rows.append({"benchmark": "engine_start", "figure": "launch of a one-shard fleet", "target": "",
                     "before_file": "bench/engine_start.py's docstring (2026-12-03, no results file)",
                     "before": "forkserver 37.5 s (cold), spawn 34.5 s, forkserver 26.3 s, spawn 33.4 s",
                     "after": launches(metrics(HERE / "engine_start.json"))})
    ab = ab_rows()
    print("| benchmark | figure | target | before | after | before's file |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        link = r["before_file"] if r["before_file"].startswith("bench/") else f"[{r['before_file']}](../{r['before_file']})"
        print(f"| `{r['benchmark']}` | {r['figure']} | {r['target']} | {r['before']} | {r['after']} | {link} |")
    if ab:
        print("\n| benchmark | figure | runs in order (old: 41bd72d's script, new: python -m bench) |")
        print("|---|---|---|")
        for r in ab:
            print(f"| `{r['benchmark']}` | {r['figure']} | {', '.join(f'{a} {v}' for a, v in r['runs'])} |")
    write_result(HERE / "compare.json", "rerun", {"before": "committed results files", "after": str(HERE)},
                 {"rows": rows, "ab": ab}, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
