"""The trajectory gateway: OpenAI chat completions on a recorded session, for agents the trainer
cannot modify.

    POST   /nemo_gen/sessions                          {"id", "base_url": "/nemo_gen/sessions/{id}/v1", "url", "shard", ...}
    POST   /nemo_gen/sessions/{id}/v1/chat/completions  the chat route (tools included), every turn recorded
    GET    /nemo_gen/sessions/{id}/v1/models           the one model
    GET    /nemo_gen/sessions/{id}/trajectory          the turns, and the token sequence with its loss mask
    DELETE /nemo_gen/sessions/{id}                     the session ends (its trajectory is returned one last time)

An unmodified OpenAI client pointed at ``url`` runs its conversation. Each turn goes through the
chat route's own pieces (``FleetApi``: the request model and its refusals, ``tools.ChatTools`` for
tool calls and parsers, ``responses.chat_response``), with one difference: the prompt is built by
the session (``nemo_gen.fleet.session.FleetSession``) on the previous turn's exact token ids —
the rule, and what happens when the agent edits history, are ``nemo_gen.core.trajectory``'s —
and sent to the fleet as token ids under the session's id, so the router keeps it on its shard
(placed at open on the shard with the fewest open sessions; a dead shard's session is placed
again, its next turn prefilled from the full token prompt there).

Recorded per turn: the request (its body, ``messages`` cut to the new ones, ``first_message`` the
index of the first of them), the engine's prompt and completion ids, logprobs, ``weight_versions``,
finish reason, shard, the answer's message. A failed turn is not recorded.

Limits (``server.*``): ``session_ttl_s`` after its last turn a session expires (404 after; a sweep
on the server's event loop, every ``sweep_interval(session_ttl_s)`` while any session is open,
takes it out and releases its shard even when no request comes), at most
``max_sessions`` open (429), at most ``max_session_bytes`` recorded per session (413, the turn not
recorded); one turn at a time per session (409); ``n`` > 1 is a 400 naming ``n``.

``stream: true`` streams as the chat route does; the turn is recorded from the stream's final
results (its message parsed whole, as the unstreamed answer's) before the final chunk, and a
turn that cannot be recorded (the byte bound) ends the stream with an error event naming it. The
session's turn lasts until the stream ends, however it ends (a client that leaves or stops reading
included: ``relay.Relay.release`` ends it before any await).

A turn costs what a chat-route request costs (``python -m bench gateway``): a plain chat (no tools
or parsers) of at most ``ON_LOOP_CHARS`` characters is prepared on the event loop — two renders of
a short chat and its continuation's tokens cost less than a thread hop — and a light response is
built there (``responses.built``); anything heavier takes one hop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from vllm.utils import random_uuid

from nemo_gen.chat.answers import message_record
from nemo_gen.core.session_table import SessionError, SessionLimits, SessionTable, sweep_interval
from nemo_gen.core.trajectory import turn_bytes
from nemo_gen.errors import ShardUnavailableError
from nemo_gen.fleet.requests import ON_LOOP_CHARS
from nemo_gen.fleet.session import FleetSession
from nemo_gen.server import protocol, responses
from nemo_gen.server.http import TIMEOUT_HEADER, cancelled_on_disconnect, read_json
from nemo_gen.server.protocol import ApiError, bad
from nemo_gen.server.tools import render_text

PREFIX = "/nemo_gen/sessions"


def _api_error(exc: SessionError) -> ApiError:
    return ApiError(exc.status, exc.message, exc.param)


class Gateway:
    """The sessions of one server over its ``FleetApi`` (``api``)."""

    def __init__(self, api: Any, settings: Any, answer: Any):
        server = settings.server
        self.api, self.answer = api, answer
        self.table: SessionTable[FleetSession] = SessionTable(
            SessionLimits(server.session_ttl_s, server.max_sessions, server.max_session_bytes))
        self.router = getattr(api.fleet, "router", None)  # places sessions (a fleet without one: none placed)
        self._sweeper: asyncio.Task | None = None

    def _release(self, sid: str) -> None:
        if self.router is not None:
            self.router.close_session(sid)

    def expire(self) -> None:
        for _, session in self.table.expire():
            session.close()

    def _sweep_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the sweep on the server's loop unless it runs (it ends when no session is open)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Expire sessions every ``sweep_interval(ttl)`` while any is open, their shards released,
        so an idle server keeps none past its TTL; the next ``create`` starts it again."""
        interval = sweep_interval(self.table.limits.ttl_s)
        while len(self.table):
            await asyncio.sleep(interval)
            self.expire()  # bookkeeping only (as every lookup's), no call to a shard

    def _session(self, sid: str, begin: bool = False) -> FleetSession:
        self.expire()
        try:
            return self.table.begin(sid) if begin else self.table.get(sid)
        except SessionError as exc:
            raise _api_error(exc) from None

    # -- routes -----------------------------------------------------------------------------------

    def create(self, body: Any, base: str) -> dict[str, Any]:
        if body not in (None, {}) and not isinstance(body, dict):
            raise bad("the request body must be a JSON object (or empty)", None)
        unknown = sorted(set(body or {}))
        if unknown:
            raise bad(f"{unknown[0]}: unknown field (a session takes none)", unknown[0])
        self.expire()
        sid = f"sess-{random_uuid()}"
        tokenizer = self.api.tools.tokenizer
        session = FleetSession(sid, tokenizer, render=lambda m, t, g: render_text(tokenizer, m, t, g),
                               on_close=self._release)
        try:
            self.table.open(session, sid)
        except SessionError as exc:
            raise _api_error(exc) from None
        shard = None
        if self.router is not None:
            try:
                shard = self.router.open_session(sid)
            except ShardUnavailableError as exc:
                self.table.close(sid)
                raise ApiError(503, f"ShardUnavailableError: {exc}") from None
        try:
            self._sweep_on(asyncio.get_running_loop())
        except RuntimeError:  # called off the loop (a test's direct call): lookups still expire
            pass
        path = f"{PREFIX}/{sid}/v1"
        return {"id": sid, "object": "nemo_gen.session", "base_url": path, "url": base.rstrip("/") + path,
                "shard": shard, "ttl_s": self.table.limits.ttl_s}

    async def chat(self, sid: str, body: Any, timeout: str | None) -> Response:
        api = self.api
        api.inflight.check_room()
        adapter = api.check_model(body)
        call = protocol.parse_chat(body, None, timeout)
        call.adapter = adapter  # a LoRA adapter named by ``model``, as on the chat route
        if call.n != 1:
            raise bad(f"n: a session's turn has one sample (a trajectory is one conversation), got n={call.n}", "n")
        session = self._session(sid, begin=True)
        streaming = False
        try:
            api.check_call(call, "messages")
            prepared = await self._prepare(call, session)
            call.prompts, call.session_id = [prepared.prompt_ids], sid
            response_id = call.request_id or f"chatcmpl-{random_uuid()}"
            if call.stream:
                def on_results(results: list[Any]) -> None:
                    result = results[0]
                    if call.turn is not None:
                        message = message_record(call.turn.message(result.text or "", result.token_ids,
                                                                   result.finish_reason)[0])
                    else:
                        message = {"role": "assistant", "content": result.text or ""}
                    self._record(sid, session, prepared, body, result, message)

                fmt = responses.StreamFormat(call, call.adapter or api.model, api.detok, response_id, chat=True)
                response = await api.stream_response(call, "messages", fmt, on_results=on_results,
                                                     on_close=lambda: self.table.end(sid))
                streaming = True  # the turn ends with the stream
                return response
            results = await api.generate(call, "messages")
            out = await responses.built(responses.chat_response, call, call.adapter or api.model, results, api.detok,
                                        response_id)
            turn = self._record(sid, session, prepared, body, results[0], message_record(out.choices[0].message))
            out.nemo_gen["session"] = {"id": sid, "turn": turn.index, "segment": turn.segment,
                                       "new_segment_reason": turn.reason}
            return self.answer(results, out)
        finally:
            if not streaming:
                self.table.end(sid)

    async def _prepare(self, call: Any, session: FleetSession) -> Any:
        """The turn's prompt (``FleetSession.prepare``), after the request is checked and
        constrained for tools and parsers (``FleetApi.with_tools``, no render: the session renders).
        A plain chat of at most ``ON_LOOP_CHARS`` characters is prepared on the event loop, as the
        router makes a short prompt into its request there: two renders of a short chat and the
        tokens of its continuation cost less than a thread hop does; the rest in one hop."""
        api = self.api
        tooled = call.tooled or api.tools.parser_cls is not None
        tools = [t.model_dump(exclude_none=True) for t in call.request.tools] if call.request.tools else None

        def prepare() -> Any:
            if tooled:
                api.with_tools(call, False)
            return session.prepare(call.prompts[0], tools)

        if not tooled and protocol.prompt_chars(call.prompts[0]) <= ON_LOOP_CHARS:
            return prepare()
        return await api.tokens.run(prepare)  # the tokenizing threads, as the chat route's rendering

    def _record(self, sid: str, session: FleetSession, prepared: Any, body: dict[str, Any], result: Any,
                message: dict[str, Any]) -> Any:
        """Record an answered turn within the session's byte bound (413 naming it, nothing recorded)."""
        request = {k: v for k, v in body.items() if k != "messages"}
        request.update(messages=prepared.plan.new, first_message=prepared.plan.at)
        try:
            self.table.charge(sid, turn_bytes(request, len(result.prompt_token_ids), len(result.token_ids)))
        except SessionError as exc:
            raise _api_error(exc) from None
        return session.record(prepared, result, message, request)

    def check(self, sid: str) -> None:
        """404 unless ``sid`` is an open session."""
        self._session(sid)

    def trajectory(self, sid: str) -> dict[str, Any]:
        return self._session(sid).trajectory().to_json()

    def delete(self, sid: str) -> dict[str, Any]:
        self.expire()
        try:
            session = self.table.close(sid)
        except SessionError as exc:
            raise _api_error(exc) from None
        session.close()
        return {**session.trajectory().to_json(), "deleted": True}


def add_routes(app: Any, api: Any, settings: Any, route: Any, answer: Any) -> Gateway:
    """The gateway's routes on ``app``, each wrapped by the server's ``route`` (errors, logging);
    ``answer(results, body)``: the chat route's response (its provenance headers)."""
    gateway = Gateway(api, settings, answer)
    app.state.gateway = gateway  # its table, for whoever holds the app (tests, an operator's shell)
    max_bytes = settings.server.max_body_bytes

    async def create(request: Request):
        empty = request.headers.get("content-length") == "0" or (
            "content-length" not in request.headers and "transfer-encoding" not in request.headers)
        body = None if empty else await read_json(request, max_bytes)
        return gateway.create(body, str(request.base_url))

    async def chat(request: Request):
        api.inflight.check_room()
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(
            request, gateway.chat(request.path_params["sid"], body, request.headers.get(TIMEOUT_HEADER)))

    async def models(request: Request):
        gateway.check(request.path_params["sid"])  # 404 for a session that is gone
        return api.models()

    async def trajectory(request: Request):
        return await asyncio.to_thread(gateway.trajectory, request.path_params["sid"])

    async def delete(request: Request):
        return await asyncio.to_thread(gateway.delete, request.path_params["sid"])

    app.add_route(PREFIX, route(create), methods=["POST"])
    app.add_route(PREFIX + "/{sid}/v1/chat/completions", route(chat), methods=["POST"])
    app.add_route(PREFIX + "/{sid}/v1/models", route(models), methods=["GET"])
    app.add_route(PREFIX + "/{sid}/trajectory", route(trajectory), methods=["GET"])
    app.add_route(PREFIX + "/{sid}", route(delete), methods=["DELETE"])
    return gateway
