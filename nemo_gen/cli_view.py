"""The terminal view of a run: steps, shards loading, a progress bar over prompts, and the
closing summary table. Driven by ``nemo_gen.progress`` events; plain lines when not a TTY."""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class LiveView:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __enter__(self) -> "LiveView":
        return self

    def __exit__(self, *exc) -> None:
        self._stop_bar()

    def _say(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{time.monotonic() - self._t0:6.1f}s[/dim]  {text}")

    def note(self, text: str) -> None:
        self._say(text)

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        with self._lock:
            if event == "step":
                extra = f" ({data['shards']} shards)" if "shards" in data else ""
                self._say(f"[bold]{data['name']}[/bold]{extra}")
            elif event == "shard":
                self._shard(data)
            elif event == "refit":
                self._say(
                    f"refit to version {data['version']}: {data['bytes'] / 1e6:.1f} MB in "
                    f"{data['seconds']:.2f} s ({data['gb_per_s']:.2f} GB/s) on {len(data['shards'])} shards"
                )
            elif event == "generate":
                self._bar(data["done"], data["total"])

    def _shard(self, data: dict[str, Any]) -> None:
        i, ev = data["index"], data["event"]
        if ev == "loading":
            self._say(f"shard {i} … loading engine")
        elif ev == "ready":
            pids = data.get("engine_pids") or []
            self._say(f"shard {i} … [green]ready[/green] ({data.get('seconds', 0):.1f} s, actor pid {data.get('actor_pid')}, engine pids {pids})")
        elif ev == "failed":
            self._say(f"shard {i} … [red]failed[/red]: {data.get('error')}")

    def _bar(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn("        generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("generate", total=total)
        self._progress.update(self._task, completed=done, total=total)
        if done >= total:
            self._stop_bar()

    def _stop_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, s: dict[str, Any], title: str = "nemo-gen run") -> None:
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        table.add_row("shards", str(s["shards"]))
        table.add_row("requests", f"{s['requests']} ({s['completed']} ok, {s['failed']} failed)")
        table.add_row("generated tokens", str(s["generated_tokens"]))
        table.add_row("tokens/s", f"{s['tokens_per_s']:.1f}")
        table.add_row("per shard", ", ".join(f"{k}: {v['requests']} req" for k, v in s["per_shard"].items()))
        table.add_row("weight version", ", ".join(map(str, s["weight_versions"])) or "-")
        if s.get("refit"):
            r = s["refit"]
            table.add_row("refit", f"{r['bytes'] / 1e6:.1f} MB, {r['seconds']:.2f} s, {r['gb_per_s']:.2f} GB/s")
        table.add_row("output", s["output"])
        if s.get("prefect_ui"):
            table.add_row("Prefect UI", s["prefect_ui"])
        table.add_row("wall time", f"{s.get('wall_seconds', 0):.1f} s")
        Console().print(table)
        for err in s["errors"][:10]:
            self.console.print(f"[yellow]line {err['line']}[/yellow]: {err['error']}")
        if len(s["errors"]) > 10:
            self.console.print(f"… and {len(s['errors']) - 10} more failed lines (see the output file)")


def status_table(fleet: str, rows: list[dict[str, Any]]) -> None:
    # GPU memory (NVML) is a column only where there are GPUs: on a CPU machine it is None.
    gpu = any(r.get("gpu_memory_bytes") is not None for r in rows)
    table = Table(title=f"fleet {fleet}", title_justify="left")
    for col in ("shard", "state", "weight version", "actor pid", "engine pids", *(("GPU memory",) if gpu else ()),
                "restarts", "last error", "orphans"):
        table.add_column(col)
    for r in rows:
        # Processes a dead actor left running (RAY_process_group_cleanup_enabled=0): pid (memory).
        orphans = " ".join(
            f"{o['pid']} ({o['rss_bytes'] / 2**30:.1f} GiB" + (f", GPU {o['gpu_bytes'] / 2**30:.1f} GiB" if o.get("gpu_bytes") else "")
            + ")" for o in r.get("orphans") or [])
        held = r.get("gpu_memory_bytes")
        table.add_row(
            str(r["index"]), r["state"], str(r["weight_version"]), str(r["actor_pid"]),
            " ".join(map(str, r["engine_pids"])), *((f"{held / 2**30:.1f} GiB" if held is not None else "",) if gpu else ()),
            str(r.get("restarts", 0)), r.get("last_error") or "", orphans,
        )
    Console().print(table)


def deploy_table(work_pool: str, template: str, automation: str, rows: list[dict[str, Any]]) -> None:
    """``template``: what became of the pool's job template (created, updated, unchanged)."""
    table = Table(title=f"deployments on work pool {work_pool!r}, its job template {template} "
                        f"(crashed runs re-run by {automation!r})", title_justify="left")
    for col in ("deployment", "id", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["deployment"], r["id"] or "", r["error"] or "")
    Console().print(table)


def not_used_comment(rows: list[dict[str, Any]]) -> str:
    """The keys read but not used, as a YAML comment block (``nemo-gen config`` stays loadable)."""
    if not rows:
        return ""
    import json

    width = min(max(len(r["key"]) for r in rows), 56)
    out = [f"# not used by nemo_gen ({len(rows)} keys: NeMo-RL's trainer and other backends, or values "
           "that ask for nothing nemo_gen lacks):"]
    for r in rows:
        value = json.dumps(r["value"], default=str)
        value = value if len(value) <= 40 else value[:37] + "..."
        out.append(f"#   {r['key']:<{width}} = {value}  -- {r['reason']}")
    return "\n".join(out) + "\n"


def describe_text(rows: list[dict[str, Any]]) -> str:
    """``nemo-gen config --describe``: each key with its type and default, then its description."""
    import json
    import textwrap

    out = []
    for r in rows:
        if r["type"] == "section":
            head = f"{r['key']}:  (section)"
        elif r["type"] == "not used":
            head = f"{r['key']}:  (NeMo-RL key, not used)"
        else:
            head = f"{r['key']}: {r['type']} = {json.dumps(r['default'], default=str)}"
        out.append(head)
        out.extend(textwrap.wrap(r["description"] or "", width=96, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out) + "\n"
