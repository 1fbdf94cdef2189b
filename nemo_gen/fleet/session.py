"""Sessions on the fleet: a multi-turn conversation whose every turn is recorded in token form.

    with fleet.session() as s:
        r1 = s.chat([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_new_tokens=64)
        ...                                           # the agent runs its tool, appends messages
        r2 = s.chat(messages + [r1.message, tool_result])  # r1.message: tool_calls, reasoning split out
        traj = s.trajectory()                        # nemo_gen.core.trajectory.Trajectory
        traj.to_json()["token_ids"], traj.to_json()["loss_mask"]

``FleetSession`` builds each turn's prompt on the previous turn's exact tokens (the rule and the
history-edit rule: ``nemo_gen.core.trajectory``), sends it to the fleet as token ids under the
session's id — the router keeps it on the shard placement chose (``nemo_gen.core.session_placement``;
re-placed if that shard stops serving) — and records the answer. The HTTP gateway
(``nemo_gen.server.gateway``) uses the same class, so both give the same ``Trajectory``.

Chat rendering and the reading of answers are the chat route's own (``nemo_gen.chat``: vLLM's
template application; ``server.tool_call_parser`` / ``server.reasoning_parser`` through vLLM's
parsers), so a library caller's ``result.message`` is the HTTP route's ``choices[0].message``.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nemo_gen.chat.answers import ChatParsers, chat_request, message_record, parse_answer
from nemo_gen.chat.constrain import adjusted, constraint
from nemo_gen.chat.render import render_chat_text
from nemo_gen.core.results import GenerationResult
from nemo_gen.core.trajectory import Plan, Trajectory, Turn, continuation_text
from nemo_gen.errors import RequestError

# render(messages, tools, add_generation_prompt) -> the template's text
Render = Callable[[list[dict[str, Any]], Any, bool], str]

NOT_A_PREFIX = "the chat template does not render the recorded conversation as a prefix of this turn's"


@dataclass
class SessionResult(GenerationResult):
    """A library session's turn: the fleet's ``GenerationResult`` (``text``, ``finish_reason``
    the engine's), plus ``message``, the assistant message the HTTP route answers with (None for
    a failed turn), and ``chat_finish_reason``, its choice's (``tool_calls`` when vLLM's is)."""

    message: dict[str, Any] | None = None
    chat_finish_reason: str | None = None


@dataclass
class Prepared:
    """A turn ready to send: how its prompt was made, its rendered text and its token ids."""

    plan: Plan
    messages: list[dict[str, Any]]
    tools: Any
    text: str
    prompt_ids: list[int]


class FleetSession:
    """One recorded conversation. ``prepare`` then ``record`` per turn (the gateway's path), or
    ``chat`` / ``chat_async`` (a library caller's); ``trajectory()``; ``close()`` releases its shard."""

    def __init__(self, session_id: str, tokenizer: Any, render: Render | None = None,
                 fleet: Any = None, on_close: Callable[[str], object] | None = None,
                 parsers: ChatParsers | None = None):
        self.id = session_id
        self.tokenizer = tokenizer
        # how a library caller's answers are read (the gateway reads its own: the chat route's)
        self.parsers = parsers or ChatParsers(None, None, tokenizer)
        self.render: Render = render or (lambda m, t, g: render_chat_text(tokenizer, m, t, g))
        self.fleet = fleet
        self._on_close = on_close
        self._record = Trajectory(session_id)
        self._lock = threading.Lock()
        self.closed = False

    # -- one turn ---------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        # The template wrote the special tokens itself (as the fleet tokenizes a chat).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prepare(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> Prepared:
        """The turn's prompt: the last segment's tokens + the continuation's, when ``messages``
        extend the record and the template renders it as a prefix; else the whole chat rendered
        (a new segment, its reason in the plan)."""
        messages = list(messages)
        record = self._record
        plan = record.plan(messages, tools)
        text = self.render(messages, tools, True)
        if plan.extend:
            last = record.turns[-1]
            answered = self.render(record.messages, tools, False)
            cont = continuation_text(record.prompt_text or "", answered, text, self._decoded(last.token_ids),
                                     *self._end(last))
            if cont is not None:
                ids = record.last_ids()  # a copy: extended in place
                ids += self.tokenize(cont)
                return Prepared(plan, messages, tools, text, ids)
            plan = Plan(extend=False, new=messages, reason=NOT_A_PREFIX)
        return Prepared(plan, messages, tools, text, self.tokenize(text))

    def _decoded(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _end(self, turn: Turn) -> tuple[str | None, bool]:
        """The end-of-message marker's text and whether the turn's sampled ids end with it: the
        stop token the engine sampled last, else the tokenizer's EOS (a turn cut at max_tokens)."""
        specials = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        if turn.token_ids and turn.finish_reason == "stop" and turn.token_ids[-1] in specials:
            return self._decoded(turn.token_ids[-1:]), True
        return getattr(self.tokenizer, "eos_token", None), False

    def record(self, prepared: Prepared, result: GenerationResult, message: dict[str, Any],
               request: dict[str, Any], persist: Callable[[Turn], None] | None = None) -> Turn:
        """Record an answered turn: ``result`` the fleet's (its prompt ids are what the engine
        saw), ``message`` the assistant message the caller was given, ``request`` what to keep of
        the request (the gateway keeps its body with only the new messages). ``persist(turn)``:
        the gateway's write to disk; what it raises takes the turn back out of the record."""
        with self._lock:
            mark = self._record.mark()
            turn = self._record.record(
                prepared.plan, prepared.messages, prepared.tools, prepared.text, result.prompt_token_ids,
                result.token_ids, result.logprobs, request=request, message=message,
                finish_reason=result.finish_reason, shard=result.shard, weight_version=result.weight_version,
                weight_versions=result.weight_versions)
            if persist is not None:
                try:
                    persist(turn)
                except BaseException:
                    self._record.rollback(mark)
                    raise
            return turn

    def restore(self, turns: Sequence[tuple[dict[str, Any], Any]]) -> None:
        """The turns a restarted gateway read back (each ``Turn.to_json`` with the tools it had),
        recorded again; the last turn's prompt text, which the next turn continues from, rendered
        again from its messages (the template is a function of them)."""
        with self._lock:
            record = self._record
            for turn, tools in turns:
                record.replay(turn, tools)
            if record.turns:
                record.prompt_text = self.render(record.messages[:-1], record.tools, True)

    def trajectory(self) -> Trajectory:
        return self._record

    # -- the library caller's path ----------------------------------------------------------------

    def _check(self, sampling: dict[str, Any], tool_choice: Any) -> None:
        if self.closed:
            raise RequestError(f"session {self.id!r} is closed")
        if self.fleet is None:
            raise RequestError("this session has no fleet to generate with (the gateway's sessions answer over HTTP)")
        if sampling.get("n", 1) != 1:
            raise RequestError("n: a session's turn has one sample (n=1); a trajectory is one conversation")
        if tool_choice not in (None, "none") and not self.parsers.auto:
            raise RequestError(f"tool_choice: tool_choice={tool_choice!r} needs a tool-call parser; set "
                               "server.tool_call_parser (a vLLM ToolParserManager name, e.g. hermes)")

    def _request(self, prepared: Prepared, chat: dict[str, Any], sampling: dict[str, Any]) -> Any:
        """vLLM's request model for the turn, adjusted for the parsers as the HTTP route adjusts
        it; a forced or strict call's grammar goes into ``sampling`` as the route sends it."""
        req = chat_request(prepared.messages, prepared.tools, **chat)
        try:
            req, constrained = adjusted(self.parsers, req)
        except ValueError as exc:  # vLLM's VLLMValidationError is one
            raise RequestError(f"{getattr(exc, 'parameter', None) or 'tools'}: {exc}") from None
        if constrained:
            sampling["structured_outputs"] = constraint(req, True, self.parsers.whitespace)
        return req

    def _answered(self, prepared: Prepared, req: Any, result: GenerationResult, sampling: dict[str, Any],
                  chat: dict[str, Any]) -> "SessionResult":
        finish = result.finish_reason
        if not result.ok:
            message = None
        elif req is None:
            message = {"role": "assistant", "content": result.text}
        else:
            parsed, finish = parse_answer(self.parsers, req, result.text or "", result.token_ids, result.finish_reason)
            message = message_record(parsed)
        if message is not None:
            self.record(prepared, result, message, {"messages": prepared.plan.new, "tools": prepared.tools,
                                                    **{k: v for k, v in chat.items() if v is not None},
                                                    "sampling": sampling})
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(GenerationResult)}
        return SessionResult(**fields, message=message, chat_finish_reason=finish)

    def _turn(self, messages: Sequence[dict[str, Any]], tools: Any, sampling: dict[str, Any],
              chat: dict[str, Any]) -> tuple[Prepared, Any, dict[str, Any]]:
        """The turn's prompt, vLLM's request model (None: no parser set) and the fleet's keywords."""
        self._check(sampling, chat.get("tool_choice"))
        prepared = self.prepare(messages, tools)
        kwargs = dict(sampling)
        req = self._request(prepared, chat, kwargs) if self.parsers.parser_cls is not None else None
        return prepared, req, kwargs

    def chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
             tool_choice: Any = None, parallel_tool_calls: bool | None = None, include_reasoning: bool | None = None,
             **sampling: Any) -> "SessionResult":
        """One turn: the fleet's result for it with ``message``, the assistant message the HTTP
        route answers (tool calls and reasoning split out by the ``server.*`` parsers: the same
        ``nemo_gen.chat.answers.parse_answer``), recorded when it succeeded (an error result is
        returned and not recorded). Send ``result.message`` back as the next turn's assistant
        message. ``tool_choice`` (``auto``, ``none``, ``required``, a named function) and
        ``parallel_tool_calls`` as on the chat route: a forced call is sampled under the parser's
        grammar, as the route samples it (``nemo_gen.chat.constrain``)."""
        chat = {"tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
                "include_reasoning": include_reasoning}
        prepared, req, kwargs = self._turn(messages, tools, sampling, chat)
        (result,) = self.fleet.generate([prepared.prompt_ids], session_id=self.id, **kwargs)
        return self._answered(prepared, req, result, sampling, chat)

    async def chat_async(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                         tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                         include_reasoning: bool | None = None, **sampling: Any) -> "SessionResult":
        chat = {"tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls,
                "include_reasoning": include_reasoning}
        prepared, req, kwargs = self._turn(messages, tools, sampling, chat)
        result = await self.fleet.generate_async(prepared.prompt_ids, session_id=self.id, **kwargs)
        return self._answered(prepared, req, result, sampling, chat)

    def close(self) -> None:
        """End the session: its shard is released (idempotent); its trajectory stays readable."""
        if not self.closed:
            self.closed = True
            if self._on_close is not None:
                self._on_close(self.id)

    def __enter__(self) -> "FleetSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
