"""The infra/data taxonomy, including Ray's exceptions recognised by name without Ray."""

from __future__ import annotations

import asyncio

import pytest

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


# Stand-ins shaped like ray.exceptions: same names, same parent relations, no Ray.
class RayError(Exception):
    pass


class RayActorError(RayError):
    pass


class ActorDiedError(RayActorError):
    pass


class ObjectLostError(RayError):
    pass


class OwnerDiedError(ObjectLostError):
    pass


class RayTaskError(RayError):
    """Like Ray's: carries the remote exception as ``.cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"task failed: {cause!r}")
        self.cause = cause


RAY_INFRA = [
    "ActorUnavailableError",
    "ActorUnschedulableError",
    "WorkerCrashedError",
    "NodeDiedError",
    "OutOfMemoryError",
    "RaySystemError",
    "GetTimeoutError",
    "TaskUnschedulableError",
    "PlacementGroupSchedulingError",
]


@pytest.mark.parametrize("name", RAY_INFRA)
def test_ray_infra_errors_recognised_by_name(name: str) -> None:
    exc_type = type(name, (RayError,), {})
    assert is_retriable(exc_type("boom"))
    assert classify(exc_type("boom")) == "infra"


def test_ray_subclasses_recognised_through_the_mro() -> None:
    class SomeNewActorError(ActorDiedError):
        pass

    assert is_retriable(RayActorError())
    assert is_retriable(ActorDiedError())
    assert is_retriable(SomeNewActorError())
    assert is_retriable(OwnerDiedError())
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
    assert is_retriable(RayTaskError(ConnectionResetError("peer")))
    assert is_retriable(RayTaskError(ShardDiedError(2)))
    assert not is_retriable(RayTaskError(ValueError("prompt too long")))
    assert is_retriable(RayTaskError(RayTaskError(ActorDiedError())))  # nested wrappers


def test_dual_class_ray_task_error_follows_the_user_exception() -> None:
    # Ray raises a class deriving from both RayTaskError and the user's exception type.
    class RayTaskError_ValueError(RayTaskError, ValueError):  # noqa: N801 (Ray's naming)
        pass

    class RayTaskError_ConfigError(RayTaskError, ConfigError):  # noqa: N801
        pass

    assert not is_retriable(RayTaskError_ValueError(ValueError("bad")))
    assert not is_retriable(RayTaskError_ConfigError(ConfigError("bad", "x")))


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
    wrapper = RayTaskError(exc)
    exc.__cause__ = wrapper
    assert not is_retriable(wrapper)


def test_http_response_errors_classified_by_status() -> None:
    class ClientResponseError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(status)
            self.status = status

    assert is_retriable(ClientResponseError(503))
    assert is_retriable(ClientResponseError(429))
    assert not is_retriable(ClientResponseError(400))


def test_describe_is_type_colon_message() -> None:
    assert describe(ValueError("bad prompt")) == "ValueError: bad prompt"
    assert describe(ShardDiedError(3, "gone")) == "ShardDiedError: shard 3 died: gone"


def test_vllm_engine_death_is_infra_even_wrapped_by_ray():
    class EngineDeadError(Exception):
        pass

    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__("ray::ShardActor.generate() failed")
            self.cause = cause

    assert is_retriable(EngineDeadError("EngineCore encountered an issue"))
    assert is_retriable(RayTaskError(EngineDeadError("dead")))
    assert not is_retriable(RayTaskError(ValueError("bad sampling params")))


def test_recovery_outcomes_that_another_attempt_cannot_fix_are_not_retried():
    from nemo_gen.errors import EngineStartError, ShardRetired, StaleShard

    assert is_retriable(EngineStartError(1, "killed while loading"))
    assert not is_retriable(ShardRetired("shard 1 retired after 5 restart attempt(s)"))
    assert not is_retriable(StaleShard("no source for weight version 3"))
