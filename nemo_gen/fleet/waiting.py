"""Waiting on one shard's answer for the router's per-request paths (``generate_async``, the
stream): the answer, or word that the shard was lost meanwhile, or the request's deadline —
whichever comes first, looking at the ledger every ``POLL_S``. The call is cancelled on its
shard whenever its answer will not be read.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from nemo_gen.core.attempts import Deadline
from nemo_gen.core.wire import GenerateReply
from nemo_gen.errors import RequestTimeout
from nemo_gen.fleet.driver import Pending, Stream

# How often a waiting generate call looks at the ledger (a shard condemned meanwhile).
POLL_S = 0.1
LOST = object()  # a stream's shard was condemned or replaced while it streamed


async def next_item(stream: Stream, lost: Callable[[], bool], deadline: Deadline,
                    timeout: Callable[[], RequestTimeout]) -> Any:
    """The stream's next item (None after its last); ``LOST`` when its shard was lost
    meanwhile (``lost()``); ``timeout()`` raised past the deadline."""
    if lost():  # (a stream whose items keep coming is seen to go too: a drained shard's moves at once)
        return LOST
    task = asyncio.ensure_future(stream.next())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=deadline.wait_s(POLL_S))
            if done:
                return task.result()
            if lost():
                return LOST
            if deadline.passed():
                raise timeout()
    finally:
        if not task.done():
            task.cancel()


async def answer(pending: Pending, lost: Callable[[], bool], deadline: Deadline,
                 timeout: Callable[[], RequestTimeout]) -> GenerateReply | None:
    """The call's answer; None when its shard was lost meanwhile; ``timeout()`` raised at the
    deadline. The call is cancelled on its shard unless it answered: at the deadline, when its
    shard was lost, and when the awaiting task itself is cancelled."""
    try:
        while True:
            done, _ = await asyncio.wait({pending.future}, timeout=deadline.wait_s(POLL_S))
            if done:
                return pending.future.result()
            if lost():
                pending.cancel()
                return None
            if deadline.passed():
                pending.cancel()
                raise timeout()
    except asyncio.CancelledError:
        pending.cancel()
        raise
