"""The FastAPI app: OpenAI's routes over a ``GenerationFleet``.

    GET  /v1/models               the model the fleet serves and its loaded LoRA adapters
    POST /v1/completions          prompt(s): a string, strings, token ids, lists of token ids
    POST /v1/chat/completions     messages, rendered with the tokenizer's chat template by the fleet;
                                  tools, tool_choice, reasoning: ``nemo_gen.server.tools``
    POST /tokenize, /detokenize   vLLM's shapes, the fleet's tokenizer (``nemo_gen.server.tokens``)
    GET  /health                  200 while a shard serves, else 503
    GET  /metrics                 Prometheus text: fleet series, per-shard vLLM series, HTTP series (no call to a shard)
    POST /nemo_gen/refit          only with server.allow_refit: a checkpoint directory -> fleet.refit
    /nemo_gen/sessions...         the trajectory gateway: recorded chat sessions (``nemo_gen.server.gateway``)

Requests are parsed in ``protocol``, answered in ``responses``, streamed by ``relay``; the
middleware, body reading and error shapes are ``http``'s. Every request goes through
``fleet.generate_async`` — the fleet's router — so the health ledger, re-routing of a lost shard's requests and the weight-version rules hold as they do for library
callers. Every response carries the header ``x-nemo-gen-weight-version`` (the version that
produced it; elsewhere the fleet's current one) and, for generations, ``x-nemo-gen-shard``; every
body a ``nemo_gen`` object. The session (shard affinity) is the ``x-session-id`` header, else the
body's ``session_id`` (vLLM's field), else ``user``.

Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 naming the
bad field, 401 for a missing or wrong key (``server.api_key``), 404 for another model or route,
413 for a body over ``server.max_body_bytes``, 503 while no shard serves, 503 with
``Retry-After`` for load (``server.max_in_flight`` reached, ``FleetBusy``), 504 when the request's
deadline passes (``timeout_s`` in the body or the ``x-nemo-gen-timeout-s`` header, else
``fleet.request_timeout_s``), 500 otherwise — the message says what failed, never a stack trace
(that goes to the log).

The event loop stays free for every request (``/health`` among them): bodies are read against
their bound and large ones parsed off the loop, long prompts are tokenized and chat templates
rendered off it (``Router.requests_async``), and heavy responses are built off it (a light one —
no logprobs or parsers, a few thousand tokens — on it: ``responses.light``; a thread hop costs
more CPU than building it). A client that disconnects before its answer is sent cancels its
requests on their engines (as vLLM's ``with_cancellation`` does), streamed or not.

Streaming (``stream: true``) is real token streaming through ``fleet.generate_stream`` (engine ->
shard actor's Ray streaming generator -> router): chunks leave as the engine makes tokens
(``responses.StreamFormat``). The response begins once every prompt of the request has its first
token, so until then a failure is an ordinary error response with its status (400, 503...) and
the headers carry the version and shard of those first tokens; a shard lost before its first
token is re-routed by the router, unseen. Once the stream has begun, a failure — a shard lost
mid-stream — ends it with an error event (``data: {"error": ...}``, which the openai client raises
as ``APIError``) naming the shard, then ``[DONE]``: never a silent truncation. A client that
disconnects, or takes no chunk for ``server.stream_idle_timeout_s``, cancels its requests on their
shards; its slots are given back however the stream ends (``relay``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
from vllm.utils import random_uuid

from nemo_gen.core.attempts import Admission
from nemo_gen.core.fleet_health import SERVING_STATES
from nemo_gen.core.manifest import RefitError
from nemo_gen.core.modes import RefitMode, parse
from nemo_gen.core.results import out_of_vocab
from nemo_gen.errors import DataError, NemoGenError, RequestError
from nemo_gen.server import protocol, responses
from nemo_gen.server.gateway import add_routes
from nemo_gen.server.http import (SESSION_HEADER, SHARD_HEADER, TIMEOUT_HEADER, VERSION_HEADER, ClientGone, Gate,
                                  cancelled_on_disconnect, error_for, error_response, read_json, version_text)
from nemo_gen.server.metrics import ServerMetrics
from nemo_gen.server.protocol import ApiError, Call
from nemo_gen.server.relay import Relay, checked, first_version
from nemo_gen.server.tokens import Tokens
from nemo_gen.server.tools import ChatTools

log = logging.getLogger(__name__)


class FleetApi:
    """The routes' logic over one fleet (duck-typed: ``generate_async``, ``weight_version``,
    ``health``, ``settings``, ``refit``; ``metrics`` / ``monitor.vllm_stats`` when the fleet has them:
    ``nemo_gen.server.metrics``)."""

    def __init__(self, fleet: Any, settings: Any, tokenizer: Any):
        self.fleet = fleet
        self.settings = settings
        self.model = settings.model_name()
        self.model_aliases = {self.model, str(settings.model_dir())}
        self.detok = responses.Detokenizer(tokenizer)
        self.tools = ChatTools(settings.server, tokenizer)
        params = inspect.signature(fleet.generate_async).parameters
        self._sessions = "session_id" in params  # the fleet routes sessions (issue 12, item 3)
        server = settings.server
        self.inflight = Admission(server.max_in_flight, server.retry_after_s, setting="server.max_in_flight",
                                  holder="the server")
        self.max_prompt_chars = server.max_prompt_chars
        resolved = getattr(fleet, "resolved", None)
        self.max_model_len = getattr(resolved, "max_model_len", None) or settings.generation.vllm_cfg.max_model_len
        self.vocab_size = getattr(resolved, "vocab_size", None)
        self.tokens = Tokens(tokenizer, self.max_model_len, self.max_prompt_chars, server.tokenize_threads)

    # -- generation -----------------------------------------------------------------------------

    def _adapters(self) -> dict[str, int]:
        versions = getattr(self.fleet, "adapter_versions", None)
        return versions() if versions is not None else {}

    def check_model(self, body: Any) -> str | None:
        """The LoRA adapter the request's ``model`` names (None: the base model, or no model sent);
        any other name is a 404 naming it and what this server serves."""
        name = body.get("model") if isinstance(body, dict) else None
        if name in (None, "") or name in self.model_aliases:
            return None
        adapters = self._adapters()
        if name in adapters:
            return name
        served = ", ".join(repr(n) for n in [self.model, *adapters])
        raise ApiError(404, f"model: the model {name!r} does not exist; this server serves {served}", "model")

    def _kwargs(self, call: Call) -> dict[str, Any]:
        kwargs = dict(call.sampling)
        if call.session_id is not None and self._sessions:
            kwargs["session_id"] = call.session_id
        if call.timeout_s is not None:
            kwargs["timeout_s"] = call.timeout_s
        if call.adapter is not None:
            kwargs["adapter"] = call.adapter
        return kwargs

    def check_call(self, call: Call, prompt_field: str) -> None:
        """What is refused before any work, as vLLM's server refuses it: a prompt over
        ``server.max_prompt_chars`` (before tokenizing it; a chat's tools and tool-call arguments
        count), ``max_tokens`` past the context, a request asking for more samples than
        ``server.max_in_flight`` could ever hold, and a token id out of the model's vocabulary (the
        fleet's router checks it too; here the message names the prompt by its index in this request)."""
        tools = getattr(call.request, "tools", None)
        for i, prompt in enumerate(call.prompts):
            protocol.check_prompt_chars(prompt, tools, self.max_prompt_chars, prompt_field)
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and \
                    (bad := out_of_vocab(i, prompt, self.vocab_size)) is not None:
                raise protocol.bad(bad, prompt_field)  # the prompt named by its index in this request
        max_new = call.sampling.get("max_new_tokens")
        if max_new is not None and self.max_model_len and max_new > self.max_model_len:
            param = "max_completion_tokens" if "max_completion_tokens" in call.sent else "max_tokens"
            raise protocol.bad(f"{param}={max_new} cannot be greater than max_model_len={self.max_model_len}. "
                               "Please request fewer output tokens.", param)
        if call.samples > (self.inflight.limit or call.samples):
            raise protocol.bad(f"n: {len(call.prompts)} prompt(s) x n={call.n} is {call.samples} samples, more than "
                               f"this server ever holds at once (server.max_in_flight={self.inflight.limit})", "n")

    async def _one(self, call: Call, prompt: Any, prompt_field: str) -> Any:
        try:
            result = await self.fleet.generate_async(prompt, **self._kwargs(call))
        except RequestError as exc:
            raise protocol.request_error(str(exc), call, prompt_field) from None
        return checked(result, call, prompt_field)

    async def generate(self, call: Call, prompt_field: str) -> list[Any]:
        with self.inflight.admitted(call.samples):
            if len(call.prompts) == 1:  # no task of its own: cancelling this one aborts it
                return [await self._one(call, call.prompts[0], prompt_field)]
            tasks = [asyncio.ensure_future(self._one(call, p, prompt_field)) for p in call.prompts]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each has aborted its request
                raise

    async def completions(self, body: Any, session: str | None, timeout: str | None = None) -> Response:
        self.inflight.check_room()
        adapter = self.check_model(body)
        call = protocol.parse_completion(body, session, timeout)
        call.adapter = adapter
        self.check_call(call, "prompt")
        response_id = call.request_id or f"cmpl-{random_uuid()}"
        if call.stream:
            fmt = responses.StreamFormat(call, call.adapter or self.model, self.detok, response_id, chat=False)
            return await self.stream_response(call, "prompt", fmt)
        results = await self.generate(call, "prompt")
        return _answer(results, await responses.built(responses.completion_response, call, call.adapter or self.model,
                                                      results, self.detok, response_id))

    async def chat(self, body: Any, session: str | None, timeout: str | None = None) -> Response:
        self.inflight.check_room()
        adapter = self.check_model(body)
        call = protocol.parse_chat(body, session, timeout)
        call.adapter = adapter
        self.check_call(call, "messages")
        if call.tooled or self.tools.parser_cls is not None:
            await self.tokens.run(self.with_tools, call)
        response_id = call.request_id or f"chatcmpl-{random_uuid()}"
        if call.stream:
            fmt = responses.StreamFormat(call, call.adapter or self.model, self.detok, response_id, chat=True)
            return await self.stream_response(call, "messages", fmt)
        results = await self.generate(call, "messages")
        return _answer(results, await responses.built(responses.chat_response, call, call.adapter or self.model,
                                                      results, self.detok, response_id))

    def with_tools(self, call: Call, render: bool = True) -> None:
        """A chat with tools, tool messages or a parser set: checked and constrained as vLLM's
        server does (``tools.ChatTools``), rendered here (``render``; the gateway renders its
        sessions' prompts itself) and its prompt token ids sent to the fleet (a plain chat with no
        parser set is rendered by the fleet, alike)."""
        call.turn = self.tools.turn(call.request, call.prompts[0])
        structured = call.turn.structured_outputs()
        if structured is not None:
            call.sampling["structured_outputs"] = structured
        # a parser reads the prompt's ids too (reasoning open at its end?)
        if render and (call.tooled or call.turn.parses):
            call.prompts = [call.turn.render()]

    async def stream_response(self, call: Call, prompt_field: str, fmt: responses.StreamFormat,
                              on_results: Callable[[list[Any]], None] | None = None,
                              on_close: Callable[[], None] | None = None) -> Response:
        """Every prompt's ``fleet.generate_stream`` at once; the response starts when each has its
        first token (until then a failure is an error response), then relays what comes. The
        request holds its place in ``server.max_in_flight`` until the stream ends, however it ends
        (``Relay.release``). ``on_results``: called with the finished results before the final
        chunk; ``on_close``: when the stream ends (synchronously: no await may come first)."""
        self.inflight.admit(call.samples)

        def closed() -> None:
            self.inflight.release(call.samples)
            if on_close is not None:
                on_close()

        relay = Relay(self.fleet, call, self._kwargs(call), prompt_field, on_close=closed, on_results=on_results)
        try:
            firsts = await relay.first_events()
        except BaseException:
            await relay.close()
            raise
        versions = [v for v in (first_version(e) for _, e in firsts) if v is not None]
        shards = {e.shard for _, e in firsts}
        headers = {VERSION_HEADER: version_text(min(versions) if versions else None), "cache-control": "no-cache"}
        if len(shards) == 1 and None not in shards:
            headers[SHARD_HEADER] = str(next(iter(shards)))
        return relay.response(fmt, firsts, headers, self.settings.server.stream_idle_timeout_s)

    # -- the rest -------------------------------------------------------------------------------

    async def tokenize(self, body: Any, detokenize: bool = False) -> dict[str, Any]:
        """/tokenize (/detokenize): admitted as one sample under ``server.max_in_flight`` — its place
        given back however it ends, with no await before — and run on the tokenizing threads."""
        with self.inflight.admitted(1):
            self.check_model(body)
            return await self.tokens.run(self.tokens.detokenize if detokenize else self.tokens.tokenize, body)

    def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.model, root=str(self.settings.model_dir()), owned_by="nemo-gen",
                         max_model_len=self.settings.generation.vllm_cfg.max_model_len)
        cards = [card] + [ModelCard(id=name, root=name, parent=self.model, owned_by="nemo-gen",
                                    max_model_len=self.settings.generation.vllm_cfg.max_model_len)
                          for name in self._adapters()]
        return {**ModelList(data=cards).model_dump(exclude_none=True), "nemo_gen": {**self._current(),
                                                                                  "adapters": self._adapters()}}

    def _current(self) -> dict[str, Any]:
        return {"weight_version": self.fleet.weight_version, "shard": None}

    def health(self) -> tuple[int, dict[str, Any]]:
        counts = {str(state.value): n for state, n in self.fleet.health.counts_by_state().items() if n}
        serving = sum(n for state, n in self.fleet.health.counts_by_state().items() if state in SERVING_STATES)
        version = self.fleet.weight_version
        body = {"status": "ok", "serving_shards": serving, "shards": counts, "nemo_gen": self._current()}
        if getattr(self.fleet, "closed", False):
            return 503, ApiError(503, "the fleet is shut down").body() | {"nemo_gen": self._current()}
        if serving == 0 or version is None:
            why = "no shard is serving" if serving == 0 else "no weights yet (fleet.mode=train, not refit)"
            return 503, ApiError(503, f"{why}; shards: {counts}").body() | {"nemo_gen": self._current()}
        return 200, body

    async def refit(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) or not body["checkpoint"]:
            raise protocol.bad("checkpoint: a checkpoint directory (a string) is required", "checkpoint")
        unknown = sorted(set(body) - {"checkpoint", "version", "in_flight"})
        if unknown:
            raise protocol.bad(f"{unknown[0]}: unknown field", unknown[0])
        version = body.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise protocol.bad("version: an integer or null", "version")
        kwargs: dict[str, Any] = {"version": version}
        if body.get("in_flight") is not None:  # the body's spelling, parsed here into the enum
            try:
                kwargs["in_flight"] = parse(RefitMode, body["in_flight"], "in_flight")
            except ValueError as exc:
                raise protocol.bad(str(exc), "in_flight") from None
        try:
            report = await asyncio.to_thread(self.fleet.refit, body["checkpoint"], **kwargs)
        except (RefitError, DataError, ValueError) as exc:
            param = "in_flight" if "in_flight" in str(exc) else "version" if "version" in str(exc) else "checkpoint"
            raise protocol.bad(str(exc), param) from None
        return {**report.to_json(), "nemo_gen": self._current()}


def _answer(results: list[Any], body: Any) -> Response:
    prov = responses.provenance(results)
    headers = {VERSION_HEADER: version_text(prov["weight_version"])}
    if prov["shard"] is not None:
        headers[SHARD_HEADER] = str(prov["shard"])
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json", headers=headers)


def build_app(fleet: Any, settings: Any, tokenizer: Any) -> Any:
    """The ASGI app (FastAPI inside ``Gate``) serving ``fleet``."""
    api = FleetApi(fleet, settings, tokenizer)
    metrics = ServerMetrics(fleet, api.inflight)
    app = FastAPI(title="nemo-gen", docs_url=None, redoc_url=None, openapi_url=None)
    version = lambda: fleet.weight_version  # noqa: E731

    def route(fn: Callable[..., Awaitable[Any]]):
        async def handler(request: Request) -> Response:
            try:
                out = await fn(request)
            except ClientGone:
                log.info("%s %s: the client disconnected; its requests were cancelled", request.method, request.url.path)
                return Response(status_code=499)  # never sent: the client is gone
            except Exception as exc:
                error = error_for(exc)
                if error.status >= 500 and not isinstance(exc, (ApiError, NemoGenError, TimeoutError)):
                    log.exception("%s %s failed", request.method, request.url.path)
                return error_response(error, version())
            return out if isinstance(out, Response) else JSONResponse(out)
        handler.__name__ = fn.__name__
        return handler

    def session(request: Request) -> str | None:
        return request.headers.get(SESSION_HEADER) or None

    max_bytes = settings.server.max_body_bytes

    async def completions(request: Request):
        api.inflight.check_room()  # full: refused before the body is even read
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(
            request, api.completions(body, session(request), request.headers.get(TIMEOUT_HEADER)))

    async def chat(request: Request):
        api.inflight.check_room()
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(
            request, api.chat(body, session(request), request.headers.get(TIMEOUT_HEADER)))

    async def models(request: Request):
        return api.models()

    async def health(request: Request):
        code, body = api.health()
        return JSONResponse(body, status_code=code)

    async def prometheus(request: Request):
        text = await asyncio.to_thread(metrics.render)
        return Response(text, media_type=metrics.CONTENT_TYPE)

    async def refit(request: Request):
        return await api.refit(await read_json(request, max_bytes))

    async def tokenize(request: Request):
        api.inflight.check_room()  # full: refused before the body is even read, as generation is
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(request, api.tokenize(body))

    async def detokenize(request: Request):
        api.inflight.check_room()
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(request, api.tokenize(body, detokenize=True))

    app.add_route("/v1/completions", route(completions), methods=["POST"])
    app.add_route("/v1/chat/completions", route(chat), methods=["POST"])
    app.add_route("/v1/models", route(models), methods=["GET"])
    app.add_route("/tokenize", route(tokenize), methods=["POST"])
    app.add_route("/detokenize", route(detokenize), methods=["POST"])
    app.add_route("/health", route(health), methods=["GET"])
    app.add_route("/metrics", route(prometheus), methods=["GET"])
    if settings.server.allow_refit:
        app.add_route("/nemo_gen/refit", route(refit), methods=["POST"])

    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail)))
        return error_response(error, version())

    add_routes(app, api, settings, route, _answer)
    app.add_exception_handler(StarletteHTTPException, not_found)
    key = settings.server.api_key.get_secret_value() if settings.server.api_key else None
    return Gate(app, key, version, metrics)
