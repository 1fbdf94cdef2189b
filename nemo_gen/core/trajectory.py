"""A session's trajectory: its turns, and the token sequence a trainer learns from.

The rule it keeps: **the masked tokens are exactly the ids the engine sampled.** A turn's prompt
is never re-tokenized from the model's own text. Turn 1's prompt is its messages rendered by the
chat template. Turn k's is, when the agent's messages extend the recorded conversation (the
previous request's messages, then the assistant message the previous turn answered, compared by
role, content and tool calls' names and arguments):

    previous prompt ids + previous sampled ids + tokens of the *continuation*

where the continuation is the text the template writes after the earlier assistant message's
sampled text: what closes that message (``continuation_text``) and everything it renders for
the new messages (tool results, a user turn, the generation prompt). The template's re-rendering
of the earlier answer itself (a tool call's JSON re-serialised, say) is never used.

When the agent's messages do not extend the record (it edited, dropped or reordered earlier
messages, changed ``tools``), or the template does not render the conversation as a prefix of
its next turn, the turn starts a new **segment**: its prompt is the whole conversation rendered
afresh, and the trajectory says why (``Turn.reason``). Every segment is one coherent token
sequence with its own mask; tokens are never mixed across segments.

Pure: messages are plain dicts (normalised by the caller), token ids plain ints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

# A message's keys the prefix check compares (reasoning is not: an agent may drop it, and the
# template's rendering decides whether that changes the prompt; the text check catches it).
_COMPARED = ("role", "content", "name", "tool_call_id")


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), args))
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two chat messages say the same: role, content ("" and None alike), name, tool call
    id, and tool calls by name and arguments (JSON compared as values; call ids and ``type`` not)."""
    for key in _COMPARED:
        x, y = a.get(key), b.get(key)
        if key == "content":
            x, y = x or "", y or ""
        if x != y:
            return False
    return _calls(a) == _calls(b)


def extension(recorded: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> tuple[int | None, str]:
    """Where ``messages`` go past ``recorded`` (its length), or (None, why not)."""
    if len(messages) < len(recorded):
        return None, f"the request has {len(messages)} messages, fewer than the {len(recorded)} recorded"
    for i, (old, new) in enumerate(zip(recorded, messages)):
        if not same_message(old, new):
            what = "the assistant message the session answered" if old.get("role") == "assistant" else "as recorded"
            return None, f"messages[{i}] ({new.get('role')}) differs from {what}"
    return len(recorded), ""


def continuation_text(prompt_text: str, answered_text: str, full_text: str, sampled_text: str,
                      end_text: str | None, sampled_ends_with_end: bool) -> str | None:
    """The text to tokenize after the previous turn's sampled ids, or None when the template does
    not render the conversation as a prefix of its next turn.

    ``prompt_text``: the previous turn's prompt (rendered); ``answered_text``: the previous
    messages and its answer rendered without a generation prompt; ``full_text``: this turn's
    messages rendered with one; ``sampled_text``: the sampled ids decoded (special tokens kept);
    ``end_text``: the template's end-of-message marker (the EOS token's text) and whether the
    sampled ids end with it. What closes the answer: the template's answer text after the sampled
    text when it re-renders it exactly; else what follows its last end marker (the marker too
    when the engine did not sample one: a turn cut at ``max_tokens``)."""
    if not (answered_text.startswith(prompt_text) and full_text.startswith(answered_text)):
        return None
    answer = answered_text[len(prompt_text):]
    if answer.startswith(sampled_text):
        close = answer[len(sampled_text):]
    elif end_text and end_text in answer:
        tail = answer[answer.rindex(end_text):]
        close = tail[len(end_text):] if sampled_ends_with_end else tail
    else:
        close = ""
    return close + full_text[len(answered_text):]


@dataclass
class Turn:
    """One recorded turn. ``prompt_token_ids`` is the engine's exact prompt (what was sent),
    ``token_ids`` / ``logprobs`` what it sampled; ``weight_versions`` (version, count) spans of
    those tokens; ``segment`` and ``offset``: where the prompt starts in that segment's sequence
    (always 0: a segment's turns each extend the one before). ``reason``: why this turn began a
    new segment (None: it extends the previous turn, or is the first)."""

    index: int
    segment: int
    request: dict[str, Any]
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    shard: int | None
    weight_version: int | None
    weight_versions: list[list[Any]]
    message: dict[str, Any]
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "segment": self.segment, "request": self.request,
                "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "shard": self.shard, "weight_version": self.weight_version,
                "weight_versions": self.weight_versions, "message": self.message, "new_segment_reason": self.reason}


@dataclass
class Segment:
    """One coherent token sequence: prompt tokens (mask 0) and sampled tokens (mask 1, with their logprobs)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                "turns": self.turns}


@dataclass
class Plan:
    """How the next turn's prompt is made: ``extend`` the last segment (``new`` messages after
    ``at`` recorded ones), or a fresh render (``reason`` says why; None for the first turn)."""

    extend: bool
    new: list[dict[str, Any]]
    at: int = 0
    reason: str | None = None


class Trajectory:
    """The record of one session: the conversation as recorded, its turns, its segments."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.messages: list[dict[str, Any]] = []  # every request's messages, then each answer
        self.tools: Any = None
        self.turns: list[Turn] = []
        self.segments: list[Segment] = []
        self.prompt_text: str | None = None  # the last turn's prompt as rendered (continuations start from it)

    def plan(self, messages: Sequence[dict[str, Any]], tools: Any) -> Plan:
        if not self.turns:
            return Plan(extend=False, new=list(messages))
        if tools != self.tools:
            return Plan(extend=False, new=list(messages), reason="tools differ from the previous turn's")
        at, why = extension(self.messages, messages)
        if at is None:
            return Plan(extend=False, new=list(messages), reason=why)
        return Plan(extend=True, new=list(messages[at:]), at=at)

    def last_ids(self) -> list[int]:
        """The last segment's sequence so far: the next extending prompt starts with it."""
        return list(self.segments[-1].token_ids) if self.segments else []

    def record(self, plan: Plan, messages: Sequence[dict[str, Any]], tools: Any, prompt_text: str,
               prompt_ids: Sequence[int], sampled: Sequence[int], logprobs: Sequence[float], *,
               request: dict[str, Any], message: dict[str, Any], finish_reason: str | None, shard: int | None,
               weight_version: int | None, weight_versions: Sequence[Sequence[Any]], reason: str | None = None) -> Turn:
        """Add one answered turn. An extending turn's ``prompt_ids`` must start with the segment's
        sequence (``ValueError`` otherwise: the caller built it wrong, and nothing is recorded)."""
        prompt_ids, sampled = list(prompt_ids), list(sampled)
        if logprobs and len(logprobs) != len(sampled):
            raise ValueError(f"{len(logprobs)} logprobs for {len(sampled)} sampled tokens")
        lps: list[float | None] = [float(x) for x in logprobs] if logprobs else [None] * len(sampled)
        if plan.extend:
            seg = self.segments[-1]
            if prompt_ids[:len(seg.token_ids)] != seg.token_ids:
                raise ValueError("an extending turn's prompt must start with its segment's tokens")
            added = prompt_ids[len(seg.token_ids):]
        else:
            seg, added = Segment(), prompt_ids
            self.segments.append(seg)
        seg.token_ids += added + sampled
        seg.loss_mask += [0] * len(added) + [1] * len(sampled)
        seg.logprobs += [None] * len(added) + lps
        turn = Turn(index=len(self.turns), segment=len(self.segments) - 1, request=request, prompt_token_ids=prompt_ids,
                    token_ids=sampled, logprobs=lps, finish_reason=finish_reason, shard=shard,
                    weight_version=weight_version, weight_versions=[list(s) for s in weight_versions],
                    message=message, reason=plan.reason if reason is None else reason)
        seg.turns.append(turn.index)
        self.turns.append(turn)
        self.messages = list(messages) + [message]
        self.tools = tools
        self.prompt_text = prompt_text
        return turn

    def mark(self) -> tuple[Any, ...]:
        """What ``rollback`` needs to take back the next ``record`` (a turn that could not be stored)."""
        last = self.segments[-1] if self.segments else None
        return (len(self.turns), len(self.segments), len(last.token_ids) if last else 0, self.messages,
                self.tools, self.prompt_text)

    def rollback(self, mark: tuple[Any, ...]) -> None:
        """Take back what was recorded since ``mark()``: the record is as it was then."""
        turns, segments, length, self.messages, self.tools, self.prompt_text = mark
        del self.turns[turns:], self.segments[segments:]
        if self.segments:
            seg = self.segments[-1]
            del seg.token_ids[length:], seg.loss_mask[length:], seg.logprobs[length:]
            seg.turns[:] = [t for t in seg.turns if t < turns]

    def replay(self, turn: dict[str, Any], tools: Any) -> Turn:
        """Record again a turn read back from its JSON (``Turn.to_json``, a gateway turn: its
        ``request`` holds the new ``messages`` and ``first_message``), with the turn's ``tools``
        as the session had them. ``prompt_text`` is left to the caller (it renders it)."""
        request = turn["request"]
        at = int(request.get("first_message") or 0)
        extend = bool(self.segments) and turn["segment"] == len(self.segments) - 1
        new = list(request["messages"])
        reason = turn.get("new_segment_reason")
        lps = turn["logprobs"]
        return self.record(Plan(extend, new, at, reason), self.messages[:at] + new, tools, "",
                           turn["prompt_token_ids"], turn["token_ids"], [] if None in lps else lps,
                           request=request, message=turn["message"], finish_reason=turn["finish_reason"],
                           shard=turn["shard"], weight_version=turn["weight_version"],
                           weight_versions=turn["weight_versions"], reason=reason)

    def to_json(self) -> dict[str, Any]:
        """The turns, and the sequence with its loss mask: top-level ``token_ids`` / ``loss_mask`` /
        ``logprobs`` are the one segment's; with several (history edited) they are None and
        ``segments`` holds each, so a trainer never joins unrelated sequences by accident."""
        one = self.segments[0] if len(self.segments) == 1 else None
        return {"id": self.session_id, "turns": [t.to_json() for t in self.turns],
                "segments": [s.to_json() for s in self.segments],
                "token_ids": one.token_ids if one else None, "loss_mask": one.loss_mask if one else None,
                "logprobs": one.logprobs if one else None,
                "completion_tokens": sum(len(t.token_ids) for t in self.turns)}


def turn_bytes(request: dict[str, Any], prompt_len: int, sampled: int) -> int:
    """What a turn adds to the session's record, as the bound counts it: its request as JSON, and
    8 bytes per token id, mask bit and logprob it holds (its prompt's ids, its sampled ids with
    their logprobs, and the segment's copy of both)."""
    return len(json.dumps(request, separators=(",", ":"), default=str)) + 8 * (2 * prompt_len + 5 * sampled)
