"""The infra/data failure taxonomy: which exceptions are worth retrying elsewhere or later.

A failure is one of two things, and the split drives every retry budget in nemo_gen:

- **infra** — the machine, a process or the network failed; the input was fine. A dead
  shard, a Ray node lost, a timeout, a dropped connection. Retrying on another shard (or
  after a backoff) is expected to succeed.
- **data** — deterministic: the same input fails the same way on any shard (bad settings,
  a prompt longer than ``max_model_len``). Retrying only burns time, so it is surfaced.

Anything not recognised as infra is data: an unknown exception is more likely a bug than a
blip, and retrying it would hide it.

Ray's exceptions are recognised by the *names* in the exception's MRO, never by importing
``ray``, so this module (and everything in ``nemo_gen.core``) stays importable without Ray.
Ray's ``RayTaskError`` wraps the exception a remote task raised; its ``.cause`` (and any
``__cause__`` chain) is followed, bounded, so the classification is that of the real error.
"""

from __future__ import annotations

from typing import Final, Literal

from nemo_gen.errors import DataError, InfraError

FailureClass = Literal["infra", "data"]

# Ray exceptions that mean a worker, node, object or the control plane went away — never
# the input. Matched by class name anywhere in the MRO, so subclasses Ray adds under these
# (ActorDiedError under RayActorError, OwnerDiedError under ObjectLostError) are covered.
# OutOfMemoryError also matches torch's CUDA OOM by name: another shard may have memory.
# Every name is one the installed Ray defines, and every exception class Ray defines has a
# recorded verdict: tests/unit/test_retry_taxonomy.py walks Ray's modules to check both.
RAY_INFRA_NAMES: Final[frozenset[str]] = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "ActorUnschedulableError",
        "WorkerCrashedError",
        "NodeDiedError",
        "LocalRayletDiedError",
        "ObjectLostError",
        "OwnerDiedError",
        "ObjectFetchTimedOutError",
        "ObjectStoreFullError",
        "OutOfDiskError",  # the object store spilled and the node's disk is full
        "OutOfMemoryError",
        "RayOutOfMemoryError",  # ray._private.memory_monitor: the node ran low on memory
        "RaySystemError",
        "RpcError",
        "GetTimeoutError",
        "TaskUnschedulableError",
        # The placement group under a task or actor was removed (its shard is being torn
        # down or its node went away): a new placement on a retry can succeed.
        "TaskPlacementGroupRemoved",
        "ActorPlacementGroupRemoved",
        "PendingCallsLimitExceeded",  # back-pressure: the actor's call queue is full for now
    }
)

# vLLM's own. vllm.exceptions splits its errors into VLLMClientError (the request: 4xx) and
# VLLMServerError (the server: 5xx); the server side is infra — EngineDeadError (the
# EngineCore process died under a live actor), EngineGenerateError, GenerationError and
# RetryableRequestError all derive from it. vLLM's GracefulHTTPError carries its own
# ``http_status`` (503 for a full queue, 409 for a busy profiler) and is classified by it.
ENGINE_INFRA_NAMES: Final[frozenset[str]] = frozenset(
    {"VLLMServerError", "EngineDeadError", "EngineGenerateError"}
)

# HTTP-client transport failures (aiohttp names; an engine died mid-request or refused the
# connection). aiohttp's ClientOSError derives from OSError but not ConnectionError, so the
# isinstance check below would miss it.

TRANSPORT_INFRA_NAMES: Final[frozenset[str]] = frozenset(
    {
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerConnectionError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
    }
)

# BrokenPipeError is a ConnectionError; listed for the reader. asyncio.TimeoutError and
# concurrent.futures.TimeoutError are aliases of TimeoutError on Python >= 3.11.
_STDLIB_INFRA_TYPES: Final[tuple[type[BaseException], ...]] = (
    ConnectionError,
    BrokenPipeError,
    TimeoutError,
)

# A self-referential or pathologically deep cause chain must not spin.
_MAX_CAUSE_DEPTH: Final[int] = 8


def http_status_is_infra(status: int) -> bool:
    """5xx, 408 and 429 mean the endpoint is unwell; any other 4xx describes the request."""
    return status >= 500 or status in (408, 429)


# Exceptions that carry an HTTP status and are classified by it: the attribute per class name.
_HTTP_STATUS_ATTRS: Final[dict[str, str]] = {
    "ClientResponseError": "status",  # aiohttp
    "GracefulHTTPError": "http_status",  # vllm.exceptions (an HTTPStatus, an int)
}


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, when its class is classified by status."""
    for cls in type(exc).__mro__:
        attr = _HTTP_STATUS_ATTRS.get(cls.__name__)
        if attr is not None:
            status = getattr(exc, attr, None)
            return status if isinstance(status, int) else None
    return None


def _single_is_infra(exc: BaseException) -> bool:
    """Whether this one exception, ignoring what it wraps, is an infra failure."""
    if isinstance(exc, InfraError):
        return True
    if isinstance(exc, DataError):
        return False
    status = _http_status(exc)
    if status is not None:
        return http_status_is_infra(status)
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & RAY_INFRA_NAMES or names & TRANSPORT_INFRA_NAMES or names & ENGINE_INFRA_NAMES:
        return True
    # ValueError, TypeError, KeyError and everything else unknown fall through to data.
    return isinstance(exc, _STDLIB_INFRA_TYPES)


def _wrapped(exc: BaseException) -> list[BaseException]:
    """What ``exc`` wraps: Ray's ``RayTaskError.cause`` first, then the ``__cause__`` chain."""
    inner: list[BaseException] = []
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        inner.append(cause)
    if exc.__cause__ is not None and exc.__cause__ is not exc:
        inner.append(exc.__cause__)
    return inner


def classify(exc: BaseException) -> FailureClass:
    """``"infra"`` if retrying ``exc`` elsewhere or later may succeed, else ``"data"``.

    An explicit ``DataError`` at the top wins: a caller that knows the input is bad has
    said so. Otherwise the exception and what it wraps are searched (breadth first,
    bounded) and the first infra failure found makes the whole thing infra.
    """
    if isinstance(exc, DataError):
        return "data"
    pending: list[tuple[BaseException, int]] = [(exc, 0)]
    seen: set[int] = set()
    while pending:
        current, depth = pending.pop(0)
        if id(current) in seen or depth > _MAX_CAUSE_DEPTH:
            continue
        seen.add(id(current))
        if _single_is_infra(current):
            return "infra"
        pending.extend((inner, depth + 1) for inner in _wrapped(current))
    return "data"


def is_retriable(exc: BaseException) -> bool:
    """True for infra failures (retry on another shard or after backoff), False for data."""
    return classify(exc) == "infra"


def describe(exc: BaseException) -> str:
    """``"Type: message"`` — the ledger's ``last_error`` format."""
    return f"{type(exc).__name__}: {exc}"
