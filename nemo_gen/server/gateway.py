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

Durable (``server.sessions_dir``, ``nemo_gen.server.session_store``): a session's opening and each
of its turns are on disk (fsync'd) before the answer is sent; a turn that cannot be written is
taken back out of the record and answered 500 naming the setting. A server started on the
directory restores every session whose TTL has not run out (the rest are removed), its turns
replayed into the same ``Trajectory`` (``Trajectory.replay``) and placed afresh (where it was is
not kept). DELETE and expiry remove a session's file. The gateway is the
store's one writer.

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
import logging
import time
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
from nemo_gen.server.session_store import FIELD, SessionStore, Stored
from nemo_gen.server.tools import render_text

log = logging.getLogger(__name__)

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
        self.store = SessionStore(settings.sessions_dir()).open()
        try:
            self._restore()
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        """Let go of the sessions directory (its lock): the server stopped. What is on disk stays."""
        self.store.close()

    def _new(self, sid: str) -> FleetSession:
        tokenizer = self.api.tools.tokenizer
        return FleetSession(sid, tokenizer, render=lambda m, t, g: render_text(tokenizer, m, t, g),
                            on_close=self._release)

    def _restore(self) -> None:
        """The sessions on disk back in the table, each idle as long as it was (wall clock); those
        whose TTL ran out meanwhile, and empty files (an opening that was never answered), removed."""
        ttl, now, restored = self.table.limits.ttl_s, time.time(), 0
        for stored in self.store.load():
            last = max((float(r.get("t", 0.0)) for r in stored.records), default=0.0)
            if not stored.records or now - last > ttl:
                self.store.remove(stored.id)
                continue
            try:
                session, nbytes = self._rebuilt(stored)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                log.warning("%s: session %s could not be restored (%s: %s); its file is left as it is",
                            self.store.path, stored.id, type(exc).__name__, exc)
                continue
            self.table.restore(stored.id, session, nbytes, now - last)
            self._place(stored.id)
            restored += 1
        if restored:
            log.info("restored %d gateway sessions from %s (server.max_sessions=%d)", restored, self.store.path,
                     self.table.limits.max_sessions)

    def _rebuilt(self, stored: Stored) -> tuple[FleetSession, int]:
        """A session from its records, and the bytes its turns count against server.max_session_bytes."""
        head, *turns = stored.records
        if head.get("kind") != "open" or head.get("id") != stored.id:
            raise ValueError("its first record is not its opening")
        replay, tools, nbytes = [], None, 0
        for record in turns:
            turn = record["turn"]
            tools = record.get("tools", tools)  # written when they changed
            replay.append((turn, tools))
            nbytes += turn_bytes(turn["request"], len(turn["prompt_token_ids"]), len(turn["token_ids"]))
        session = self._new(stored.id)
        session.restore(replay)
        return session, nbytes

    def _place(self, sid: str) -> None:
        """A restored session placed afresh (where it was is not kept); with no shard serving yet
        its turns are routed as a bare session id's until it is closed."""
        if self.router is not None:
            try:
                self.router.open_session(sid)
            except ShardUnavailableError:
                pass

    def _forget(self, sid: str) -> None:
        """A session that ended: its file removed (a failure is logged; the session is gone either way)."""
        try:
            self.store.remove(sid)
        except OSError as exc:
            log.warning("%s: session %s's file could not be removed: %s", self.store.path, sid, exc)

    def _release(self, sid: str) -> None:
        if self.router is not None:
            self.router.close_session(sid)

    def expire(self) -> None:
        for sid, session in self.table.expire():
            session.close()
            self._forget(sid)

    def sweeping(self) -> None:
        """Start the sweep if sessions are open (restored ones included) and it does not run."""
        if len(self.table):
            self._sweep_on(asyncio.get_running_loop())

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
        session = self._new(sid)
        try:
            self.table.open(session, sid)
        except SessionError as exc:
            raise _api_error(exc) from None
        try:
            self.store.create(sid, {"kind": "open", "id": sid, "t": time.time()})
        except OSError as exc:
            self.table.close(sid)
            raise ApiError(500, f"the session could not be stored in {FIELD} {self.store.path}: {exc}", FIELD) from None
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
            turn = await self._recorded(sid, session, prepared, body, results[0], message_record(out.choices[0].message))
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

    async def _recorded(self, *args: Any) -> Any:
        """``_record`` off the loop (its fsync), on disk before the answer goes. A request cancelled
        meanwhile (its client gone) still waits for it, so the session's turn ends after its record."""
        task = asyncio.ensure_future(asyncio.to_thread(self._record, *args))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise

    def _record(self, sid: str, session: FleetSession, prepared: Any, body: dict[str, Any], result: Any,
                message: dict[str, Any]) -> Any:
        """Record an answered turn within the session's byte bound (413 naming it, nothing recorded),
        on disk before it returns (500 naming server.sessions_dir if it cannot be: nothing recorded)."""
        request = {k: v for k, v in body.items() if k != "messages"}
        request.update(messages=prepared.plan.new, first_message=prepared.plan.at)
        nbytes = turn_bytes(request, len(result.prompt_token_ids), len(result.token_ids))
        try:
            self.table.charge(sid, nbytes)
        except SessionError as exc:
            raise _api_error(exc) from None
        before = session.trajectory()
        new_tools = not before.turns or prepared.tools != before.tools  # tools are written when they change

        def persist(turn: Any) -> None:
            record = {"kind": "turn", "t": time.time(), "turn": turn.to_json()}
            if new_tools:
                record["tools"] = prepared.tools
            self.store.append(sid, record)

        try:
            return session.record(prepared, result, message, request, persist)
        except OSError as exc:
            self.table.refund(sid, nbytes)
            raise ApiError(500, f"the turn could not be stored in {FIELD} {self.store.path} and was not "
                           f"recorded: {exc}", FIELD) from None
        except BaseException:
            self.table.refund(sid, nbytes)
            raise

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
        self._forget(sid)
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
        gateway.sweeping()  # restored sessions are swept from a restarted server's first request on
        body = await read_json(request, max_bytes)
        return await cancelled_on_disconnect(
            request, gateway.chat(request.path_params["sid"], body, request.headers.get(TIMEOUT_HEADER)))

    async def models(request: Request):
        gateway.sweeping()
        gateway.check(request.path_params["sid"])  # 404 for a session that is gone
        return api.models()

    async def trajectory(request: Request):
        gateway.sweeping()
        return await asyncio.to_thread(gateway.trajectory, request.path_params["sid"])

    async def delete(request: Request):
        gateway.sweeping()
        return await asyncio.to_thread(gateway.delete, request.path_params["sid"])

    app.add_route(PREFIX, route(create), methods=["POST"])
    app.add_route(PREFIX + "/{sid}/v1/chat/completions", route(chat), methods=["POST"])
    app.add_route(PREFIX + "/{sid}/v1/models", route(models), methods=["GET"])
    app.add_route(PREFIX + "/{sid}/trajectory", route(trajectory), methods=["GET"])
    app.add_route(PREFIX + "/{sid}", route(delete), methods=["DELETE"])
    return gateway
