"""The fault model: what kind of trouble an exception is, and so what the fleet does about it.

Four kinds, each with its own evidence and its own answer:

- **dead** — the shard cannot serve: its actor, engine process or node is gone, the
  connection to it broke, a control call it must answer at once went unanswered. The shard
  is condemned (DEAD), reaped and restarted; its requests go to another shard.
- **busy** — the shard refused admission for now: vLLM's queue is full
  (``max_num_queued_reqs`` / ``max_num_queued_tokens``: ``QueueOverflowError``, 503), an
  HTTP 429 or 503, Ray's ``PendingCallsLimitExceeded``. The shard is healthy; the request is
  retried on another shard with backoff, a bounded number of times, then ``FleetBusy``.
- **slow** — a deadline passed while the engine still made progress (``RequestTimeout``,
  an HTTP 408 or 504). That one request fails and is aborted on its engine; the shard serves on.
- **data** — deterministic: the same input fails the same way on any shard (bad settings,
  a prompt longer than ``max_model_len``). Retrying only burns time, so it is surfaced.

Only *dead* condemns a shard. Anything not recognised is data: an unknown exception is more
likely a bug than a blip, and retrying it would hide it. The older two-way split
(``classify``: infra/data) is kept for retry budgets: dead, busy and slow are infra.

Ray's exceptions are recognised by the *names* in the exception's MRO, never by importing
``ray``, so this module (and everything in ``nemo_gen.core``) stays importable without Ray.
Ray's ``RayTaskError`` wraps the exception a remote task raised; its ``.cause`` (and any
``__cause__`` chain) is followed, bounded, so the kind is that of the real error.
"""

from __future__ import annotations

from typing import Final, Iterator, Literal

from nemo_gen.core import wire
from nemo_gen.errors import DataError, FleetBusy, InfraError, RequestTimeout, ShardBusy

FailureClass = Literal["infra", "data"]
# The kinds are the wire's enum (one type of that name): ``kind_of`` answers a member.
FailureKind = wire.FailureKind
DEAD, BUSY, SLOW, DATA = FailureKind.DEAD, FailureKind.BUSY, FailureKind.SLOW, FailureKind.DATA

# Ray exceptions that mean a worker, node, object or the control plane went away — never
# the input. Matched by class name anywhere in the MRO, so subclasses Ray adds under these
# (ActorDiedError under RayActorError, OwnerDiedError under ObjectLostError) are covered.
# OutOfMemoryError also matches torch's CUDA OOM by name: another shard may have memory.
# Every name is one the installed Ray defines, and every exception class Ray defines has a
# recorded verdict: tests/tooling/test_retry_taxonomy.py walks Ray's modules to check both.
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
    }
)

# Admission refused for now by a live shard: never its death. Ray's back-pressure (the actor's
# call queue is full) and vLLM's full request queue (QueueOverflowError and MaxQueuedTokensError
# are GracefulHTTPErrors with http_status 503, matched by status below; named here too).
BUSY_NAMES: Final[frozenset[str]] = frozenset(
    {"PendingCallsLimitExceeded", "QueueOverflowError", "MaxQueuedTokensError"}
)

# vLLM's own. vllm.exceptions splits its errors into VLLMClientError (the request: 4xx) and
# VLLMServerError (the server: 5xx); the server side is infra — EngineDeadError (the
# EngineCore process died under a live actor), EngineGenerateError, GenerationError and
# RetryableRequestError all derive from it. vLLM's GracefulHTTPError carries its own
# ``http_status`` (503 for a full queue, 409 for a busy profiler) and is classified by it.
ENGINE_INFRA_NAMES: Final[frozenset[str]] = frozenset(
    {"VLLMServerError", "EngineDeadError", "EngineGenerateError"}
)

# vLLM's errors caused by the request (``vllm.exceptions.VLLMClientError``: VLLMValidationError,
# VLLMNotFoundError, ...; vLLM's server answers them 4xx). Data, as anything unrecognised is; named
# so that their own words can be the caller's answer (``client_error``) instead of Ray's wrapper.
CLIENT_NAMES: Final[frozenset[str]] = frozenset({"VLLMClientError"})

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


def http_status_kind(status: int) -> FailureKind:
    """429 and 503: busy (come back later); 408 and 504: slow (a deadline passed); any other
    5xx: the endpoint is unwell (dead); any other 4xx describes the request (data)."""
    if status in (429, 503):
        return BUSY
    if status in (408, 504):
        return SLOW
    return DEAD if status >= 500 else DATA


def http_status_is_infra(status: int) -> bool:
    """5xx, 408 and 429 mean the endpoint is unwell or busy; any other 4xx describes the request."""
    return http_status_kind(status) is not DATA


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


def _single_kind(exc: BaseException) -> FailureKind | None:
    """The kind of this one exception, ignoring what it wraps; None: not recognised."""
    if isinstance(exc, (ShardBusy, FleetBusy)):
        return BUSY
    if isinstance(exc, RequestTimeout):
        return SLOW
    if isinstance(exc, InfraError):
        return DEAD
    if isinstance(exc, DataError):
        return DATA
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & BUSY_NAMES:
        return BUSY
    status = _http_status(exc)
    if status is not None:
        return http_status_kind(status)
    if names & RAY_INFRA_NAMES or names & TRANSPORT_INFRA_NAMES or names & ENGINE_INFRA_NAMES:
        return DEAD
    # ValueError, TypeError, KeyError and everything else unknown fall through to data.
    return DEAD if isinstance(exc, _STDLIB_INFRA_TYPES) else None


def _wrapped(exc: BaseException) -> list[BaseException]:
    """What ``exc`` wraps: Ray's ``RayTaskError.cause`` first, then the ``__cause__`` chain."""
    inner: list[BaseException] = []
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        inner.append(cause)
    if exc.__cause__ is not None and exc.__cause__ is not exc:
        inner.append(exc.__cause__)
    return inner


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps, breadth first, each once, at most ``_MAX_CAUSE_DEPTH`` deep."""
    pending: list[tuple[BaseException, int]] = [(exc, 0)]
    seen: set[int] = set()
    while pending:
        current, depth = pending.pop(0)
        if id(current) in seen or depth > _MAX_CAUSE_DEPTH:
            continue
        seen.add(id(current))
        yield current
        pending.extend((inner, depth + 1) for inner in _wrapped(current))


def kind_of(exc: BaseException) -> FailureKind:
    """``DEAD``, ``BUSY``, ``SLOW`` or ``DATA`` (``FailureKind``): see the module doc.

    An explicit ``DataError`` at the top wins: a caller that knows the input is bad has said
    so. Otherwise the exception and what it wraps are searched (breadth first, bounded) and
    the first one recognised gives the kind; none recognised: data.
    """
    if isinstance(exc, DataError):
        return DATA
    for current in _chain(exc):
        kind = _single_kind(current)
        if kind is not None and kind is not DATA:
            return kind
    return DATA


def failure(exc: BaseException, said: BaseException | None = None) -> wire.Failure:
    """``exc`` as the wire's ``Failure``: its kind (``kind_of``), and the type and last line of
    what the shard said (``said``: the exception a transport's error wraps; ``exc`` itself by
    default). One form whichever way the call went: over Ray, over the direct line, in process."""
    type_name, _, detail = wire.exception_line(said or exc).partition(": ")
    return wire.Failure(kind_of(exc), type_name, detail)


def client_error(exc: BaseException) -> BaseException | None:
    """The vLLM client error (``CLIENT_NAMES``) that ``exc`` is or wraps, the innermost one (the
    actor-side exception, not Ray's ``RayTaskError`` copy of it with the actor's pid, IP and id
    in its text); None when there is none."""
    found = None
    for current in _chain(exc):  # breadth first: the last one found is the innermost
        if {cls.__name__ for cls in type(current).__mro__} & CLIENT_NAMES:
            found = current
    return found


# Signals that end a process from outside (an operator, the OOM killer, a shutdown): SIGHUP,
# SIGINT, SIGQUIT, SIGKILL, SIGTERM. Such a death says nothing about the requests the engine ran.
OUTSIDE_SIGNALS: Final[frozenset[int]] = frozenset({1, 2, 3, 9, 15})


def ended_on_its_own(exit_code: int | None) -> bool:
    """Whether an EngineCore that ``exit_code`` ended (negative: the signal that killed it; None:
    not ended, or unknown) failed by itself: an exception in its step (vLLM's EngineCore exits
    with 1) or a fatal signal of its own (SIGSEGV, SIGABRT, SIGBUS, SIGFPE). Its running
    requests may be the cause: no engine is risked on them again."""
    if exit_code is None or exit_code == 0:
        return False
    return exit_code > 0 or -exit_code not in OUTSIDE_SIGNALS


def classify(exc: BaseException) -> FailureClass:
    """``"infra"`` if retrying ``exc`` elsewhere or later may succeed (dead, busy, slow),
    else ``"data"``."""
    return "data" if kind_of(exc) is DATA else "infra"


def is_retriable(exc: BaseException) -> bool:
    """True for infra failures (retry on another shard or after backoff), False for data."""
    return classify(exc) == "infra"


def condemns(exc: BaseException) -> bool:
    """Whether ``exc`` is evidence that its shard is dead (the only kind that condemns one)."""
    return kind_of(exc) is DEAD


def describe(exc: BaseException) -> str:
    """``"Type: message"`` — the ledger's ``last_error`` format."""
    return f"{type(exc).__name__}: {exc}"
