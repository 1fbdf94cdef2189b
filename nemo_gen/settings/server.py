"""The ``server`` section and its defaults (the OpenAI-compatible HTTP server), and the
exposure rule it and the server share: ``is_loopback``, ``exposure_problem``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from nemo_gen.settings.base import Section, invalid, one_of


class ServerSettings(Section):
    """`nemo-gen serve` (and `generation.vllm_cfg.expose_http_server`): the OpenAI-compatible HTTP
    server in front of the fleet (``nemo_gen.server``)."""

    host: str = Field(
        "127.0.0.1", description="Address the HTTP server binds (127.0.0.1: this machine only). Any other "
        "(0.0.0.0, a name, an outside address) without server.api_key is warned about at start, and refused "
        "with server.allow_refit.",
    )
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP server; 0: a free one, chosen at start.")
    api_key: SecretStr | None = Field(
        None, description="When set, every request but /health and /metrics needs `Authorization: Bearer "
        "<api_key>` (a missing or wrong key gets 401); unset: no key needed. Shown masked.",
    )
    allow_refit: bool = Field(
        False, description="Serve POST /nemo_gen/refit (a checkpoint directory on this machine, loaded into "
        "the fleet as fleet.refit does; guarded by api_key). Off: the route does not exist. On a host other "
        "than a loopback address it needs server.api_key.",
    )
    max_in_flight: int = Field(
        512, ge=1, description="Samples the server has in flight at once (a request of k prompts with n "
        "samples each counts k x n); a request that would go past it is answered 503 with Retry-After at "
        "once, before any of its work is done, and one larger than it alone is answered 400. /health and "
        "/metrics are never held back by it.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Seconds the Retry-After header of a 503 for load (server.max_in_flight, "
        "FleetBusy) tells a client to wait.",
    )
    max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="Largest request body the server reads; a larger one is answered "
        "413 before it is read whole.",
    )
    max_prompt_chars: int = Field(
        2**20, ge=1, description="Longest prompt, in characters (a chat: its messages' content, its "
        "assistant messages' tool-call arguments and its tools' definitions as JSON, together), the server "
        "tokenizes or renders, /tokenize included; a longer one is answered 400 naming the field, before "
        "any tokenizing: rendering a chat template costs about its length in CPU time.",
    )
    tokenize_threads: int = Field(
        2, ge=1, description="Threads that tokenize and render chat templates for the server's routes "
        "(/tokenize, /detokenize, chats with tools or parsers, gateway turns), apart from the threads "
        "that build responses: heavy tokenizing waits its turn there and never delays another "
        "request's other work. Work beyond them queues; the queue is bounded by server.max_in_flight, "
        "which admits every such request.",
    )
    header_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a connection has to send a request's headers whole, counted "
        "from its opening or from its first byte after an answer; past it the server closes the "
        "connection, so half-sent requests cannot hold sockets open (as nginx's client_header_timeout).",
    )
    keep_alive_s: float = Field(
        30.0, gt=0, description="Seconds an idle keep-alive connection stays open after its last answer "
        "(uvicorn's timeout_keep_alive); clients that pool connections reuse them within it.",
    )
    max_connections: int = Field(
        4096, ge=1, description="Connections the server holds at once (uvicorn's limit_concurrency); "
        "past it a request is answered 503 at once and its connection closed. Each open connection "
        "holds a file descriptor and a buffer; server.header_timeout_s closes the ones that stall.",
    )
    stream_idle_timeout_s: float = Field(
        60.0, gt=0, description="A streamed response (stream: true) whose client takes no chunk for this many "
        "seconds (one send to it waits that long: the client stopped reading, its socket open) is ended: its "
        "connection closed, its requests aborted on their engines and its server.max_in_flight slots given "
        "back. Without it a stalled reader holds its slots for the stream's whole length while what it has "
        "not read piles up in the server. Time the engines take to make tokens does not count.",
    )
    session_ttl_s: float = Field(
        600.0, gt=0, description="A trajectory-gateway session (POST /nemo_gen/sessions) expires this many "
        "seconds after its last turn ended (or its opening, before any turn); a turn in flight keeps it alive. "
        "An expired session is gone (404) and its shard released.",
    )
    max_sessions: int = Field(
        1024, ge=1, description="Trajectory-gateway sessions open at once; one more is answered 429 naming "
        "this setting (no open session is dropped to make room).",
    )
    max_session_bytes: int = Field(
        64 * 2**20, ge=1024, description="Largest record one gateway session keeps (its turns' requests as "
        "JSON and their token ids, masks and logprobs); a turn that would pass it is answered 413 naming "
        "this setting and not recorded, and the session stays readable.",
    )
    sessions_dir: Path | None = Field(
        None, description="Directory where the trajectory gateway keeps its sessions (one append-only "
        "file each; every turn fsync'd before its response is sent), so a restarted server serves the same "
        "sessions and trajectories. Unset: `home`/sessions/<fleet.name>. Made 0700 if missing; a symlink, a "
        "file or another user's directory there is refused, never followed. One server writes it at a time.",
    )

    tool_call_parser: str | None = Field(
        None, description="vLLM's tool-call parser (its ToolParserManager name: hermes, llama3_json, "
        "pythonic...) that reads tool calls out of the model's text for tool_choice auto, and constrains "
        "required / named ones; unset: a request with tool_choice other than none is answered 400.",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto", description="vLLM's --tool-strict-level: the least a request with tools is constrained to. auto: "
        "tool_choice required / a named function force the call's envelope, and a tool's arguments follow its "
        "schema when the tool says strict: true; function: every request with tools gets the envelope; "
        "parameter: every tool's arguments follow its schema, as if each were strict.",
    )
    tool_call_whitespace: int | None = Field(
        4, ge=0, description="Longest run of whitespace characters the grammar of a constrained tool call "
        "(tool_choice required / named, server.tool_strict_level) lets the model write between JSON tokens "
        "(xgrammar's max_whitespace_cnt); null: unbounded, as vLLM leaves it. Bounded, a model that favours "
        "whitespace (a random one) still closes its call within max_tokens.",
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM's reasoning parser (its ReasoningParserManager name: deepseek_r1, qwen3...) "
        "that splits the model's reasoning out of a chat answer into message.reasoning; unset: none is split.",
    )

    @field_validator("sessions_dir")
    @classmethod
    def _a_directory_of_ours(cls, value: Path | None) -> Path | None:
        """Refused now rather than at the server's start: a symlink (never followed: it could point
        the records anywhere) or something other than a directory."""
        if value is None:
            return value
        if not str(value).strip():
            raise ValueError("must name a directory (unset it for `home`/sessions/<fleet.name>)")
        if value.is_symlink():
            raise ValueError(f"{value} is a symlink; name the directory itself (a symlink is never followed)")
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} exists and is not a directory")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        return value if value is None else one_of(value, vllm_choices.tool_parsers(), "a tool-call parser vLLM registers")

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        return value if value is None else one_of(value, vllm_choices.reasoning_parsers(),
                                                  "a reasoning parser vLLM registers")

    @model_validator(mode="after")
    def _refit_open_to_the_network(self) -> "ServerSettings":
        why = exposure_problem(self.host, self.allow_refit, self.api_key)
        if why:
            raise invalid(type(self).__name__, ("allow_refit",), True, "allow_refit", "{why}", {"why": why})
        return self


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only: ``localhost`` or a
    loopback address. Any other name (it may resolve anywhere), address, or "" (every interface) is not."""
    import ipaddress

    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, allow_refit: bool, api_key: SecretStr | None) -> str | None:
    """Why the server may not start this way (None: it may): ``/nemo_gen/refit``, which loads a
    directory of this machine into the fleet, open without a key beyond this machine. An empty
    key is no key (the server then asks for none)."""
    if allow_refit and not api_key and not is_loopback(host):
        return (f"server.allow_refit would let anyone who reaches server.host {host!r} (not a loopback "
                "address) load a checkpoint directory of this machine into the fleet, and server.api_key is "
                "unset: set server.api_key, bind server.host to 127.0.0.1, or turn server.allow_refit off")
    return None

