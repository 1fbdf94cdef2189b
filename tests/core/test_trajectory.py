"""The pure parts of the trajectory gateway (issue 33, items 3-4): the prefix check, the
continuation after an earlier answer, trajectory assembly and its mask, the session table's TTL
and bounds, and session placement — each with its failure paths."""

from __future__ import annotations

import pytest

from nemo_gen.core.session_placement import SessionPlacement
from nemo_gen.core.session_table import SessionError, SessionLimits, SessionTable, sweep_interval
from nemo_gen.core.trajectory import Plan, Trajectory, continuation_text, extension, same_message, turn_bytes

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


# -- the prefix check ------------------------------------------------------------------------------

def test_messages_compare_by_what_they_say():
    ours = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "other", "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}]}
    assert same_message(ours, echoed)  # None and "" alike, arguments as JSON values, ids not compared
    assert not same_message(ours, {**echoed, "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Oslo"}'}}]})
    assert not same_message({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert not same_message({"role": "tool", "content": "x", "tool_call_id": "1"},
                            {"role": "tool", "content": "x", "tool_call_id": "2"})


def test_extension_finds_the_new_messages_or_says_why_not():
    recorded = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert extension(recorded, recorded + [{"role": "user", "content": "more"}]) == (2, "")
    assert extension(recorded, recorded) == (2, "")
    at, why = extension(recorded, recorded[:1])
    assert at is None and "fewer" in why
    at, why = extension(recorded, [recorded[0], {"role": "assistant", "content": "edited"}])
    assert at is None and "messages[1]" in why and "answered" in why


# -- the continuation ---------------------------------------------------------------------------------

P = "<s>user\nhi</s>\n<s>assistant\n"


def test_the_continuation_closes_the_answer_then_renders_the_new_messages():
    answered = P + "hello</s>\n"
    full = answered + "<s>user\nmore</s>\n<s>assistant\n"
    # the engine sampled "hello" and the end token: the template's "\n" after it, then the new turn
    assert continuation_text(P, answered, full, "hello</s>", "</s>", True) == "\n<s>user\nmore</s>\n<s>assistant\n"


def test_a_re_serialised_answer_keeps_what_follows_its_end_marker():
    # the template writes the call's JSON with keys sorted: not the sampled text, never used
    answered = P + '<tool_call>{"arguments": {}, "name": "f"}</tool_call></s>\n'
    full = answered + "<s>tool\nsunny</s>\n<s>assistant\n"
    sampled = '<tool_call>{"name": "f", "arguments": {}}</tool_call></s>'
    assert continuation_text(P, answered, full, sampled, "</s>", True) == "\n<s>tool\nsunny</s>\n<s>assistant\n"
    # cut at max_tokens (no end sampled): the marker is added to close the message
    assert continuation_text(P, answered, full, sampled[:-4] + "x", "</s>", False) == \
        "</s>\n<s>tool\nsunny</s>\n<s>assistant\n"


def test_a_template_that_is_not_prefix_stable_gives_none():
    answered = P + "hello</s>\n"
    assert continuation_text(P, answered, "<s>system\nnew</s>\n" + answered, "hello</s>", "</s>", True) is None
    assert continuation_text(P, "<s>user\nHI</s>\n<s>assistant\nhello</s>\n", "x", "hello</s>", "</s>", True) is None


# -- assembly and the mask ----------------------------------------------------------------------------

def _record(traj: Trajectory, plan: Plan, messages, prompt, sampled, shard=0, reason=None):
    return traj.record(plan, messages, None, "text", prompt, sampled, [-0.5] * len(sampled), request={},
                       message={"role": "assistant", "content": f"a{len(traj.turns)}"}, finish_reason="stop",
                       shard=shard, weight_version=3, weight_versions=[[3, len(sampled)]], reason=reason)


def test_masked_tokens_are_exactly_the_sampled_ids_and_prompts_extend():
    traj = Trajectory("s")
    m1 = [{"role": "user", "content": "q"}]
    assert not traj.plan(m1, None).extend
    _record(traj, traj.plan(m1, None), m1, [1, 2, 3], [10, 11])
    m2 = m1 + [{"role": "assistant", "content": "a0"}, {"role": "tool", "content": "r"}]
    plan = traj.plan(m2, None)
    assert plan.extend and plan.at == 2 and plan.new == [{"role": "tool", "content": "r"}]
    _record(traj, plan, m2, traj.last_ids() + [4, 5], [12, 13, 14], shard=1)
    out = traj.to_json()
    assert out["token_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert out["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    masked = [t for t, m in zip(out["token_ids"], out["loss_mask"]) if m]
    assert masked == [t for turn in out["turns"] for t in turn["token_ids"]]
    assert sum(out["loss_mask"]) == out["completion_tokens"] == 5
    assert out["turns"][1]["prompt_token_ids"][:5] == out["turns"][0]["prompt_token_ids"] + out["turns"][0]["token_ids"]
    assert out["logprobs"] == [None] * 3 + [-0.5] * 2 + [None] * 2 + [-0.5] * 3
    assert [t["shard"] for t in out["turns"]] == [0, 1]


def test_an_extending_prompt_that_drops_sampled_ids_is_refused_and_nothing_recorded():
    traj = Trajectory("s")
    m1 = [{"role": "user", "content": "q"}]
    _record(traj, traj.plan(m1, None), m1, [1, 2], [10, 11])
    m2 = m1 + [{"role": "assistant", "content": "a0"}, {"role": "user", "content": "r"}]
    with pytest.raises(ValueError, match="must start with"):
        _record(traj, traj.plan(m2, None), m2, [1, 2, 99, 4], [12])  # a re-tokenized answer
    assert len(traj.turns) == 1 and traj.to_json()["token_ids"] == [1, 2, 10, 11]
    with pytest.raises(ValueError, match="logprobs"):
        traj.record(traj.plan(m2, None), m2, None, "t", [1, 2, 10, 11, 4], [12], [0.0, 0.0], request={},
                    message={}, finish_reason=None, shard=0, weight_version=0, weight_versions=[])


def test_an_edited_history_starts_a_flagged_segment_and_nothing_is_mixed():
    traj = Trajectory("s")
    m1 = [{"role": "user", "content": "q"}]
    _record(traj, traj.plan(m1, None), m1, [1, 2], [10])
    edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "not what was said"},
              {"role": "user", "content": "next"}]
    plan = traj.plan(edited, None)
    assert not plan.extend and "messages[1]" in plan.reason
    _record(traj, plan, edited, [1, 2, 7, 8], [20])
    out = traj.to_json()
    assert out["token_ids"] is None and out["loss_mask"] is None  # two sequences: never joined silently
    assert [s["token_ids"] for s in out["segments"]] == [[1, 2, 10], [1, 2, 7, 8, 20]]
    assert [s["loss_mask"] for s in out["segments"]] == [[0, 0, 1], [0, 0, 0, 0, 1]]
    assert out["turns"][1]["segment"] == 1 and "messages[1]" in out["turns"][1]["new_segment_reason"]
    assert not traj.plan(edited + [{"role": "assistant", "content": "a1"}], [{"t": 1}]).extend  # tools changed


def test_turn_bytes_grow_with_the_request_and_the_tokens():
    assert turn_bytes({"a": "x" * 100}, 10, 5) > turn_bytes({"a": "x"}, 10, 5) > turn_bytes({"a": "x"}, 1, 1)


# -- the session table ----------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_sessions_expire_after_their_ttl_but_not_while_a_turn_runs():
    clock = Clock()
    table = SessionTable(SessionLimits(ttl_s=10, max_sessions=4, max_bytes=1000), clock)
    a, _ = table.open("A")
    b, _ = table.open("B")
    table.begin(b)
    clock.t = 11
    assert table.expire() == [(a, "A")]  # b holds a turn: alive
    with pytest.raises(SessionError) as err:
        table.get(a)
    assert err.value.status == 404
    table.end(b)
    clock.t = 20
    assert table.get(b) == "B"
    clock.t = 31.5
    with pytest.raises(SessionError, match="session_ttl_s"):
        table.get(b)
    assert table.expire() == [(b, "B")] and len(table) == 0


def test_expiry_follows_last_use_not_the_order_sessions_were_opened_in():
    clock = Clock()
    table = SessionTable(SessionLimits(ttl_s=10, max_sessions=8, max_bytes=1000), clock)
    a, _ = table.open("A")
    b, _ = table.open("B")
    c, _ = table.open("C")
    clock.t = 5
    table.begin(a)
    table.end(a)  # A used last
    table.begin(b)  # B holds a turn
    clock.t = 11
    assert table.expire() == [(c, "C")]  # A used 6 s ago; B busy
    clock.t = 14
    table.end(b)
    clock.t = 15.5
    assert table.expire() == [(a, "A")]
    clock.t = 23.5
    assert table.expire() == [] and table.get(b) == "B"  # used at 14, when its turn ended
    clock.t = 24.5
    assert table.expire() == [(b, "B")] and len(table) == 0


def test_the_sweep_runs_a_quarter_ttl_apart_and_never_more_than_30_s():
    assert sweep_interval(600) == 30.0 and sweep_interval(60) == 15.0 and sweep_interval(0.4) == 0.1
    assert sweep_interval(0) == 0.0


def test_the_table_bounds_sessions_bytes_and_concurrent_turns():
    table = SessionTable(SessionLimits(ttl_s=10, max_sessions=2, max_bytes=100), Clock())
    a, _ = table.open("A")
    table.open("B")
    with pytest.raises(SessionError) as err:
        table.open("C")
    assert err.value.status == 429 and "server.max_sessions=2" in err.value.message
    table.charge(a, 60)
    with pytest.raises(SessionError) as err:
        table.charge(a, 50)
    assert err.value.status == 413 and "server.max_session_bytes=100" in err.value.message
    assert table.bytes_of(a) == 60  # the refused turn counted nothing
    table.begin(a)
    with pytest.raises(SessionError) as err:
        table.begin(a)
    assert err.value.status == 409
    assert table.close(a) == "A"
    with pytest.raises(SessionError):
        table.close(a)
    table.open("C")  # room again


# -- placement ---------------------------------------------------------------------------------------------

def test_new_sessions_go_to_the_shard_with_the_fewest_then_the_least_in_flight():
    placement = SessionPlacement()
    inflight = {0: 5, 1: 0, 2: 1}
    assert placement.place("a", [0, 1, 2], inflight.get) == 1
    assert placement.place("b", [0, 1, 2], inflight.get) == 2  # 0 and 2 have none: 2 is less busy
    assert placement.place("c", [0, 1, 2], inflight.get) == 0
    assert placement.place("d", [0, 1, 2], inflight.get) == 1  # all hold one: least in flight
    assert placement.counts() == {0: 1, 1: 2, 2: 1}
    assert placement.release("d") == 1 and placement.release("d") is None  # idempotent
    assert placement.active(1) == 1
    assert placement.place("e", [0, 2], inflight.get) == 2  # shard 1 not serving: among the others


def test_a_session_re_placed_moves_its_count_and_nothing_serving_is_an_error():
    placement = SessionPlacement()
    placement.place("a", [0, 1])
    placement.place("b", [0, 1])
    assert placement.slot_of("a") == 0
    assert placement.place("a", [1]) == 1  # its shard died: it moves
    assert placement.counts() == {1: 2} and len(placement) == 2
    with pytest.raises(ValueError, match="no shard serves"):
        placement.place("c", [])
    assert placement.slot_of("c") is None
