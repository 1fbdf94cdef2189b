"""The nemo_gen exception tree: one place that says which failures are worth retrying.

    NemoGenError
    ├── InfraError                 retriable: the machine or a process failed, the input was fine
    │   ├── ShardDiedError         dead: a shard's actor or engine process is gone
    │   │   └── EngineCrashError   its engine failed on its own while it ran the request: the
    │   │                          request may be the cause, so it is sent to no other engine
    │   ├── ShardBusy              busy: one shard refused admission (its queue is full)
    │   ├── FleetBusy              busy: no shard admits the request now (HTTP 503 + Retry-After)
    │   │   └── FleetAsleep        the fleet sleeps (colocated layout): nothing is admitted until
    │   │                          it is woken; no shard is at fault (HTTP 503 + Retry-After)
    │   ├── ShardUnavailableError  no shard can take the request right now (NoHealthyShards)
    │   ├── EngineStartError       an engine failed to come up (timeout, crash while loading)
    │   └── FleetExhausted         fewer serving shards than health.min_healthy_shards
    ├── RequestTimeout             slow: one request's deadline passed (HTTP 504); also a
    │                              TimeoutError. Its shard is not at fault and serves on.
    ├── ShardRetired               not retriable: a shard spent health.max_restart_attempts_per_shard
    ├── StaleShard                 not retriable: a replacement is up but nothing can bring it to
    │                              the fleet's weight version before the next refit
    └── DataError                  not retriable: the same input fails the same way again
        ├── ConfigError            bad settings; names the dotted field (``fleet.num_shards``)
        ├── PlacementError         the cluster cannot hold the fleet as configured
        ├── RequestError           one generation request is invalid (too long, bad sampling)
        └── InputFileError         a prompts file is unreadable or a line is malformed

Only *dead* condemns a shard; *busy* is retried elsewhere and *slow* fails the one request
(``nemo_gen.core.retry``: the fault model). Adapters (ray, vllm, prefect) translate their own
exceptions into these in one place each; ``nemo_gen.core.retry.kind_of`` classifies both
these and raw Ray and vLLM exceptions.
"""

from __future__ import annotations


class NemoGenError(Exception):
    """Base of every error nemo_gen raises on purpose."""


class InfraError(NemoGenError):
    """A failure of the infrastructure, not the input: retrying elsewhere or later may succeed."""


class ShardDiedError(InfraError):
    """A shard's actor or engine process died while it held work."""

    def __init__(self, shard: int, detail: str = ""):
        self.shard = shard
        self.detail = detail
        super().__init__(f"shard {shard} died" + (f": {detail}" if detail else ""))

    def __reduce__(self):  # crosses Ray and processes with its fields, not its message
        return type(self), (self.shard, self.detail)


class EngineCrashError(ShardDiedError):
    """A shard's EngineCore ended on its own (an exception in its step, a fatal signal such as
    SIGSEGV: not a kill from outside) while it ran the request. The request may be what killed
    it (a poison pill), so it fails with this error and is sent to no other engine: one request
    never buys a second engine's death. The shard is condemned and recovered as for any death."""


class ShardBusy(InfraError):
    """A shard refused a request for now (vLLM's queue is full, HTTP 429/503, Ray's
    pending-call limit): it is alive and serving, the request goes to another shard."""

    def __init__(self, shard: int, detail: str = ""):
        self.shard = shard
        self.detail = detail
        super().__init__(f"shard {shard} is busy" + (f": {detail}" if detail else ""))

    def __reduce__(self):
        return type(self), (self.shard, self.detail)


class FleetBusy(InfraError):
    """The fleet admits no more requests now: its pending bound (``fleet.max_pending_requests``)
    is reached, or every shard tried refused the request. Retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class FleetAsleep(FleetBusy):
    """The fleet is asleep, or going to sleep (``fleet.sleep``, ``VllmGeneration.finish_generation``):
    a state, not a fault. The message names the state and the call that wakes it."""


class RequestTimeout(NemoGenError, TimeoutError):
    """One request's deadline passed (``timeout_s``, ``fleet.request_timeout_s``; a stream's
    between two tokens). The request was aborted on its engine; the shard serves on."""

    def __init__(self, message: str, shard: int | None = None):
        self.shard = shard
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.shard)


class ShardUnavailableError(InfraError):
    """No shard is eligible to serve at the moment."""


class EngineStartError(InfraError):
    """A vLLM engine did not come up."""

    def __init__(self, shard: int, detail: str):
        self.shard = shard
        super().__init__(f"shard {shard}: engine failed to start: {detail}")


class FleetExhausted(InfraError):
    """Fewer shards are serving than the policy's minimum (NeMo-RL's GenerationFleetExhausted)."""


class ShardRetired(NemoGenError):
    """A shard spent its restart attempts (health.max_restart_attempts_per_shard). Not
    retriable: neither infra nor data, it is the policy's final answer."""


class StaleShard(NemoGenError):
    """A replacement is up but nothing can bring it to the fleet's version until the next
    refit (the version came from live tensors pushed by another process). Not retriable:
    restarting again would not help."""


class DataError(NemoGenError):
    """A failure caused by the input: retrying the same input cannot succeed."""


class ConfigError(DataError, ValueError):
    """Invalid settings. ``field`` is the dotted path of the offending key, when known."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class PlacementError(DataError):
    """The Ray cluster cannot hold the fleet as configured (raised instead of hanging)."""


class RequestError(DataError, ValueError):
    """One generation request is invalid; the rest of its batch is unaffected."""

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        super().__init__(message)


class InputFileError(DataError, ValueError):
    """A prompts file or one of its lines cannot be used. Names the file and line."""

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
