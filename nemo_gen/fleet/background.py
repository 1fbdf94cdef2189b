"""The fleet's background work and whether the fleet is still open.

Recovery and spare starts run on one small thread pool; ``close`` marks the fleet closed and
wakes anything waiting in ``wait_closed``; ``join`` waits for what runs. ``closed`` is the one place the
fleet's open/closed state lives.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from nemo_gen.errors import NemoGenError

# Enough for a recovery per slot of a small fleet plus spare starts; the work waits on Ray.
_WORKERS = 4


class Background:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix=f"nemo-gen-{name}")
        self._closed = threading.Event()
        self.detached = False  # closed by detach(): what runs belongs to the fleet, not to us

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def check_open(self) -> None:
        if self.closed:
            raise NemoGenError("the fleet has been shut down")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:  # shutting down
            return None

    def wait_closed(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; returns early (True) when the fleet is shut down."""
        return self._closed.wait(seconds)

    def close(self, detached: bool = False) -> None:
        """No new work from here on; wakes ``wait_closed``. ``join`` waits for what runs."""
        self.detached = detached
        self._closed.set()

    def join(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
