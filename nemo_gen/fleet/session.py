"""Sessions on the fleet: a multi-turn conversation whose every turn is recorded in token form.

    with fleet.session() as s:
        r1 = s.chat([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_new_tokens=64)
        ...                                           # the agent runs its tool, appends messages
        r2 = s.chat(messages + [{"role": "assistant", "content": r1.text}, tool_result])
        traj = s.trajectory()                        # nemo_gen.core.trajectory.Trajectory
        traj.to_json()["token_ids"], traj.to_json()["loss_mask"]

``FleetSession`` builds each turn's prompt on the previous turn's exact tokens (the rule and the
history-edit rule: ``nemo_gen.core.trajectory``), sends it to the fleet as token ids under the
session's id — the router keeps it on the shard placement chose (``nemo_gen.core.session_placement``;
re-placed if that shard stops serving) — and records the answer. The HTTP gateway
(``nemo_gen.server.gateway``) uses the same class, so both give the same ``Trajectory``.

Chat rendering is vLLM's (``safe_apply_chat_template`` over the tokenizer's template, tool-call
arguments made objects first), as the chat route renders a prompt with tools.
"""

from __future__ import annotations

import copy
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nemo_gen.core.results import GenerationResult
from nemo_gen.core.trajectory import Plan, Trajectory, Turn, continuation_text
from nemo_gen.errors import RequestError

# render(messages, tools, add_generation_prompt) -> the template's text
Render = Callable[[list[dict[str, Any]], Any, bool], str]

NOT_A_PREFIX = "the chat template does not render the recorded conversation as a prefix of this turn's"


def render_chat_text(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """A chat as the tokenizer's chat template writes it, through vLLM's template application
    (tool-call arguments made objects first, as vLLM's renderer does). vLLM's
    ``VLLMValidationError`` passes through; no template: ``RequestError``."""
    from vllm.renderers.chat_utils import _postprocess_messages
    from vllm.renderers.hf import safe_apply_chat_template

    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages: this prompt is a chat, but the tokenizer (model.tokenizer, or the model's own) "
                           "has no chat template")
    conversation = copy.deepcopy(list(messages))
    _postprocess_messages(conversation)
    return safe_apply_chat_template(None, tokenizer, conversation, tools=tools or None,
                                    chat_template=tokenizer.chat_template, tokenize=False,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)


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
                 fleet: Any = None, on_close: Callable[[str], None] | None = None):
        self.id = session_id
        self.tokenizer = tokenizer
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
                return Prepared(plan, messages, tools, text, record.last_ids() + self.tokenize(cont))
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
               request: dict[str, Any]) -> Turn:
        """Record an answered turn: ``result`` the fleet's (its prompt ids are what the engine
        saw), ``message`` the assistant message the caller was given, ``request`` what to keep of
        the request (the gateway keeps its body with only the new messages)."""
        with self._lock:
            return self._record.record(
                prepared.plan, prepared.messages, prepared.tools, prepared.text, result.prompt_token_ids,
                result.token_ids, result.logprobs, request=request, message=message,
                finish_reason=result.finish_reason, shard=result.shard, weight_version=result.weight_version,
                weight_versions=result.weight_versions)

    def trajectory(self) -> Trajectory:
        return self._record

    # -- the library caller's path ----------------------------------------------------------------

    def _check(self, sampling: dict[str, Any]) -> None:
        if self.closed:
            raise RequestError(f"session {self.id!r} is closed")
        if self.fleet is None:
            raise RequestError("this session has no fleet to generate with (the gateway's sessions answer over HTTP)")
        if sampling.get("n", 1) != 1:
            raise RequestError("n: a session's turn has one sample (n=1); a trajectory is one conversation")

    def _answered(self, prepared: Prepared, result: GenerationResult, sampling: dict[str, Any]) -> GenerationResult:
        if result.ok:
            message = {"role": "assistant", "content": result.text}
            self.record(prepared, result, message, {"messages": prepared.plan.new, "tools": prepared.tools,
                                                    "sampling": sampling})
        return result

    def chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             **sampling: Any) -> GenerationResult:
        """One turn: the fleet's ``GenerationResult`` for it, recorded when it succeeded (an error
        result is returned and not recorded). The assistant message the record expects next is
        ``{"role": "assistant", "content": result.text}``."""
        self._check(sampling)
        prepared = self.prepare(messages, tools)
        (result,) = self.fleet.generate([prepared.prompt_ids], session_id=self.id, **sampling)
        return self._answered(prepared, result, sampling)

    async def chat_async(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                         **sampling: Any) -> GenerationResult:
        self._check(sampling)
        prepared = self.prepare(messages, tools)
        result = await self.fleet.generate_async(prepared.prompt_ids, session_id=self.id, **sampling)
        return self._answered(prepared, result, sampling)

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


class SessionVerbs:
    """``GenerationFleet.session()``: a mixin, so the facade stays small."""

    router: Any
    _tokenizer: Any

    def session(self, session_id: str | None = None) -> FleetSession:
        """A new recorded session (``nemo_gen.fleet.session``), placed on the serving shard with the
        fewest open sessions; ``close()`` it (or use it as a context manager) to release the shard."""
        self.background.check_open()  # type: ignore[attr-defined]
        sid = session_id or f"sess-{secrets.token_hex(12)}"
        self.router.open_session(sid)
        return FleetSession(sid, self._tokenizer, fleet=self, on_close=self.router.close_session)
