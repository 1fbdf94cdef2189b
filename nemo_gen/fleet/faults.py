"""What Ray and vLLM raise, told in the fault model's terms (``nemo_gen.core.retry``): ``classify``
maps an exception into ``nemo_gen.errors`` (dead -> ``ShardDiedError``, busy -> ``ShardBusy``,
vLLM's client errors -> ``RequestError``, other slow and data ones unchanged), ``failure_of``
into the wire's ``Failure``, and ``root_cause`` names the actor-side exception a Ray error wraps. Used by the driver's calls and by a shard's launch.
"""

from __future__ import annotations

import ray

from nemo_gen.core.retry import client_error, failure, kind_of
from nemo_gen.core.wire import Failure, FailureKind, exception_line
from nemo_gen.errors import NemoGenError, RequestError, ShardBusy, ShardDiedError
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.transport import Unanswered


def root_cause(exc: BaseException) -> str:
    """``Type: last line`` of what a Ray error wraps (the actor-side exception, not Ray's frame):
    the same form a shard's direct line answers in (``nemo_gen.core.wire.exception_line``)."""
    return exception_line(getattr(exc, "cause", None) or exc)


def failure_of(exc: BaseException) -> Failure:
    """A Ray error (or the actor's exception it wraps) as a wire ``Failure``: its fault-model kind,
    and the actor-side exception's type and last line (``root_cause``)."""
    return failure(exc, getattr(exc, "cause", None))


def unanswered(method: str, wait: float) -> Failure:
    """A call that outlived its deadline: the shard is frozen or gone (dead, not slow: the workers
    enforce the refit deadline, so a live shard answers within it)."""
    return Failure(FailureKind.DEAD, "GetTimeoutError", f"{method} did not answer within {wait:g}s")


def classify(handle: ShardHandle | None, exc: BaseException, what: str, timeout_s: float | None = None) -> BaseException:
    """The one mapping from Ray's and vLLM's exceptions to nemo_gen's: dead -> ShardDiedError
    (naming the call), busy -> ShardBusy, vLLM's refusal of the request (``VLLMClientError``) ->
    RequestError, anything else unchanged (a slow or data failure is the caller's to see)."""
    if isinstance(exc, NemoGenError):  # the actor's own; through Ray, without Ray's frame around it
        cause = getattr(exc, "cause", None)
        return cause if isinstance(cause, NemoGenError) else exc
    index = handle.index if handle is not None and handle.index is not None else -1
    if isinstance(exc, (Unanswered, ray.exceptions.GetTimeoutError)):
        return ShardDiedError(index, f"{what} did not answer within {timeout_s:g}s")
    kind = kind_of(exc)
    if kind is FailureKind.DATA and (client := client_error(exc)) is not None:
        # vLLM refused the request (an id out of vocabulary, a bad parameter): the caller's
        # RequestError, in vLLM's words and without Ray's frame around them
        return RequestError(exception_line(client))
    if kind is FailureKind.BUSY:
        return ShardBusy(index, root_cause(exc))
    if kind is FailureKind.DEAD:
        return ShardDiedError(index, root_cause(exc))
    return exc
