"""The artifacts every flow publishes, in one place: fleet health, generation throughput and
progress on long work (refit timing is ``flows.refit.publish_refit``).

Artifacts are what an operator reads in the UI instead of logs, and whoever can read the UI
can read them: every text cell goes through ``redact`` first (credentials in URLs, tokens,
keys), because an error message or a path can carry one.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Iterable, Iterator, Mapping

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from nemo_gen import progress

_SECRETS = [
    # scheme://user:password@host -> scheme://***@host
    (re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), r"\g<scheme>***@"),
    (re.compile(r"(?i)\bBearer\s+[A-Za-z0-9._~+/=-]+"), "Bearer ***"),
    # key=value / key: value for names that hold secrets
    (re.compile(r"(?i)\b(?P<k>[\w.-]*(?:token|secret|password|passwd|api[_-]?key|auth)[\w.-]*)(?P<sep>\s*[=:]\s*)"
                r"(?P<q>['\"]?)[^\s'\",;]+"), r"\g<k>\g<sep>\g<q>***"),
    # well-known token shapes: Hugging Face, OpenAI-style, GitHub, AWS access keys
    (re.compile(r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16})\b"), "***"),
]


def redact(value: Any) -> Any:
    """``value`` with anything that looks like a credential masked (non-strings unchanged)."""
    if not isinstance(value, str):
        return value
    for pattern, repl in _SECRETS:
        value = pattern.sub(repl, value)
    return value


def publish_table(key: str, rows: Iterable[Mapping[str, Any]], description: str) -> None:
    create_table_artifact(
        key=key,
        table=[{k: redact(v) for k, v in row.items()} for row in rows],
        description=redact(description),
    )


def health_rows(status: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per shard from ``fleet.status()`` (ShardStatus objects or their JSON)."""
    rows = []
    for s in status:
        s = s.to_json() if hasattr(s, "to_json") else s
        rows.append({"shard": s["index"], "state": s["state"], "weight_version": s["weight_version"],
                     "restarts": s["restarts"], "last_error": s["last_error"] or ""})
    return rows


def publish_fleet_health(fleet_name: str, status: Iterable[Any], when: str = "at the end of the run") -> list[dict[str, Any]]:
    rows = health_rows(status)
    publish_table("fleet-health", rows, f"Fleet {fleet_name!r}: shard states {when}")
    return rows


def publish_throughput(summary: Mapping[str, Any]) -> None:
    """Requests, generated tokens and tokens/s per shard, and the total over the run."""
    seconds = summary["generate_seconds"]
    rows = [
        {"shard": shard, "requests": v["requests"], "tokens": v["tokens"],
         # shards generate concurrently over the same wall time
         "tokens_per_s": round(v["tokens"] / seconds, 1) if seconds > 0 else 0.0}
        for shard, v in summary["per_shard"].items()
    ]
    rows.append({"shard": "all", "requests": summary["completed"], "tokens": summary["generated_tokens"],
                 "tokens_per_s": round(summary["tokens_per_s"], 1)})
    publish_table("generation-throughput", rows, f"Requests and generated tokens per shard ({summary['failed']} failed)")


@contextlib.contextmanager
def progress_artifact(description: str, kinds: tuple[str, ...] = ("generate",), total: int | None = None) -> Iterator[None]:
    """A progress artifact (0-100 %) driven by ``nemo_gen.progress`` events while the block runs:
    ``generate`` (done/total prompts) and ``shard`` (engines ready out of ``total``)."""
    artifact_id = create_progress_artifact(progress=0.0, description=description)
    lock = threading.Lock()
    state = {"ready": 0, "last": 0.0}

    def update(pct: float) -> None:
        with lock:
            # Rounded to whole percent and only forward: one API call per visible step.
            pct = round(min(100.0, pct))
            if pct <= state["last"]:
                return
            state["last"] = pct
        update_progress_artifact(artifact_id=artifact_id, progress=pct)

    def on_event(kind: str, data: dict[str, Any]) -> None:
        if kind not in kinds:
            return
        if kind == "generate" and data.get("total"):
            update(100.0 * data["done"] / data["total"])
        elif kind == "shard" and data.get("event") == "ready" and total:
            with lock:
                state["ready"] += 1
                ready = state["ready"]
            update(100.0 * ready / total)

    with progress.listening(on_event):
        yield
    update(100.0)
