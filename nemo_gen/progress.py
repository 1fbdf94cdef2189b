"""Progress events from the pipeline to whoever shows them (the CLI's live view, logs).

The library and the Prefect tasks call ``emit``; the CLI subscribes with ``listening``. Every
event is also logged, so a run without a listener (a Prefect worker) still tells its story.
Events: ``step`` (name, status), ``shard`` (index, event, seconds, ...), ``generate`` (done, total).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

log = logging.getLogger("nemo_gen.progress")

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def emit(kind: str, **data: Any) -> None:
    log.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in data.items()))
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(kind, data)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def shard_event(index: int, event: str, detail: dict[str, Any]) -> None:
    """Adapter from ``launch_shards``' ``progress(index, event, detail)`` callback to ``emit``."""
    emit("shard", **{**detail, "index": index, "event": event})
