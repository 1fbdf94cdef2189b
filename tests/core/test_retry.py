"""The infra/data taxonomy on Ray's real exception classes (ray is installed; nothing here
needs a cluster) and nemo_gen's own. Every class Ray and vLLM define is checked against a
recorded verdict in test_retry_taxonomy.py; here: subclasses, wrapping and cause chains."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import (
    ActorDiedError,
    ActorPlacementGroupRemoved,
    GetTimeoutError,
    OwnerDiedError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskPlacementGroupRemoved,
)

from nemo_gen.core.retry import classify, describe, is_retriable
from nemo_gen.errors import (
    ConfigError,
    EngineStartError,
    FleetExhausted,
    InputFileError,
    PlacementError,
    RequestError,
    ShardDiedError,
    ShardUnavailableError,
)


def task_error(cause: BaseException) -> RayTaskError:
    """What ``ray.get`` raises for a remote call that raised ``cause``: Ray's own wrapper, made
    the way Ray makes it (a class deriving from both RayTaskError and the cause's class)."""
    return RayTaskError("ShardActor.generate", "Traceback ...", cause).as_instanceof_cause()


def test_placement_group_removal_is_retried() -> None:
    # Ray 2.60 raises these when the placement group under a task or actor goes away; they
    # used to fall through to "data" while a name Ray does not define was listed as infra.
    assert classify(TaskPlacementGroupRemoved()) == "infra"
    assert classify(ActorPlacementGroupRemoved()) == "infra"
    assert is_retriable(task_error(TaskPlacementGroupRemoved()))  # as a controller task sees it


def test_ray_subclasses_recognised_through_the_mro() -> None:
    class SomeNewActorError(ActorDiedError):
        pass

    assert is_retriable(RayActorError())
    assert is_retriable(ActorDiedError())
    assert is_retriable(SomeNewActorError())
    assert is_retriable(OwnerDiedError(object_ref_hex="ab" * 28, owner_address="", call_site=""))
    assert is_retriable(GetTimeoutError("timed out"))
    assert not is_retriable(RayError("generic"))  # unknown: data


@pytest.mark.parametrize(
    "exc",
    [
        ShardDiedError(1, "actor gone"),
        ShardUnavailableError("none"),
        EngineStartError(0, "timeout"),
        FleetExhausted("too few"),
        ConnectionError(),
        ConnectionRefusedError(),
        BrokenPipeError(),
        TimeoutError(),
        asyncio.TimeoutError(),
    ],
)
def test_infra(exc: BaseException) -> None:
    assert is_retriable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ConfigError("bad", field="fleet.num_shards"),
        PlacementError("too big"),
        RequestError("too long"),
        InputFileError("p.jsonl", "bad json", line=3),
        ValueError("x"),
        TypeError("x"),
        KeyError("x"),
        RuntimeError("unknown is data"),
        ZeroDivisionError(),
    ],
)
def test_data(exc: BaseException) -> None:
    assert not is_retriable(exc)
    assert classify(exc) == "data"


def test_ray_task_error_classifies_its_cause() -> None:
    assert is_retriable(task_error(ConnectionResetError("peer")))
    assert is_retriable(task_error(ShardDiedError(2)))
    assert not is_retriable(task_error(ValueError("prompt too long")))
    assert not is_retriable(task_error(ConfigError("bad", "x")))
    # nested: an actor that called another actor that died
    assert is_retriable(task_error(task_error(ActorDiedError())))


def test_ray_task_error_is_both_wrapper_and_cause() -> None:
    # Ray's dual class derives from the user's exception type, so an isinstance check on it
    # succeeds; the taxonomy must still follow the cause and not stop at "ValueError".
    wrapped = task_error(ValueError("bad"))
    assert isinstance(wrapped, RayTaskError) and isinstance(wrapped, ValueError)
    assert not is_retriable(wrapped)
    wrapped = task_error(TimeoutError("engine step"))
    assert isinstance(wrapped, TimeoutError) and is_retriable(wrapped)


def test_dunder_cause_chain_is_followed() -> None:
    try:
        try:
            raise TimeoutError("engine slow")
        except TimeoutError as inner:
            raise RuntimeError("generate failed") from inner
    except RuntimeError as outer:
        assert is_retriable(outer)


def test_explicit_data_error_wins_over_infra_cause() -> None:
    exc = RequestError("too long")
    exc.__cause__ = ConnectionError()
    assert not is_retriable(exc)


def test_self_referential_chain_terminates() -> None:
    exc = RuntimeError("loop")
    wrapper = RayTaskError("f", "", exc)
    exc.__cause__ = wrapper
    assert not is_retriable(wrapper)


def test_http_response_errors_classified_by_status() -> None:
    from aiohttp import ClientResponseError

    def response(status: int) -> ClientResponseError:
        return ClientResponseError(None, (), status=status, message="x")  # type: ignore[arg-type]

    assert is_retriable(response(503))
    assert is_retriable(response(429))
    assert is_retriable(response(408))
    assert not is_retriable(response(400))
    assert not is_retriable(response(404))


def test_every_transport_name_is_an_aiohttp_class_and_infra() -> None:
    import aiohttp

    from nemo_gen.core.retry import TRANSPORT_INFRA_NAMES

    for name in sorted(TRANSPORT_INFRA_NAMES):
        cls = getattr(aiohttp, name)  # a name aiohttp does not define would match nothing
        assert classify(cls.__new__(cls)) == "infra", name


def test_describe_is_type_colon_message() -> None:
    assert describe(ValueError("bad prompt")) == "ValueError: bad prompt"
    assert describe(ShardDiedError(3, "gone")) == "ShardDiedError: shard 3 died: gone"


def test_recovery_outcomes_that_another_attempt_cannot_fix_are_not_retried():
    from nemo_gen.errors import EngineStartError, ShardRetired, StaleShard

    assert is_retriable(EngineStartError(1, "killed while loading"))
    assert not is_retriable(ShardRetired("shard 1 retired after 5 restart attempt(s)"))
    assert not is_retriable(StaleShard("no source for weight version 3"))


# ---- the fault model: dead / busy / slow / data, and only dead condemns ----------------------


def test_admission_refused_is_busy_not_dead() -> None:
    """vLLM's full queue (503), Ray's pending-call limit and an HTTP 429/503 say "come back
    later" about a live shard: busy, never a reason to condemn it (they were read as a dead
    shard, so one overloaded shard's requests overflowed the next and the fleet cascaded)."""
    from ray.exceptions import PendingCallsLimitExceeded
    from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError

    from nemo_gen.core.retry import condemns, kind_of
    from nemo_gen.errors import FleetBusy, ShardBusy

    for exc in (QueueOverflowError(), MaxQueuedTokensError(), PendingCallsLimitExceeded("full"),
                ShardBusy(1, "queue full"), FleetBusy("no shard admits it"),
                task_error(QueueOverflowError())):  # as ray.get raises it from a shard actor
        assert kind_of(exc) == "busy", exc
        assert not condemns(exc)
        assert is_retriable(exc)  # another shard, or later, may take it


def test_a_passed_deadline_is_slow_and_a_lost_process_is_dead() -> None:
    from nemo_gen.core.retry import condemns, kind_of
    from nemo_gen.errors import RequestTimeout

    assert kind_of(RequestTimeout("deadline passed", shard=0)) == "slow"
    assert not condemns(RequestTimeout("deadline passed"))
    assert isinstance(RequestTimeout("x"), TimeoutError)  # asyncio.wait_for-style handlers catch it
    for exc in (ActorDiedError(), ShardDiedError(0, "gone"), ConnectionResetError(), task_error(ActorDiedError())):
        assert kind_of(exc) == "dead" and condemns(exc)
    for exc in (ValueError("bad"), RequestError("too long"), RayError("generic")):
        assert kind_of(exc) == "data" and not condemns(exc)


@pytest.mark.parametrize("status,kind", [(429, "busy"), (503, "busy"), (408, "slow"), (504, "slow"),
                                         (500, "dead"), (502, "dead"), (400, "data"), (404, "data"),
                                         (409, "data")])
def test_http_statuses_by_kind(status: int, kind: str) -> None:
    from vllm.exceptions import GracefulHTTPError

    from nemo_gen.core.retry import http_status_kind, kind_of

    assert http_status_kind(status) == kind
    assert kind_of(GracefulHTTPError("x", status)) == kind
