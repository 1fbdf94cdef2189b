"""``core.delta_queue.DeltaQueue``: what a slow stream reader has not taken waits merged, one delta
per choice, in order (pure logic; the server's side: tests/fake/test_server_streams.py)."""

from __future__ import annotations

import pytest

from nemo_gen.core.delta_queue import DeltaQueue
from nemo_gen.core.results import Delta


def delta(sample, ids, text, version=3, finish=None, shard=0):
    return Delta(sample=sample, token_ids=list(ids), text=text, logprobs=[-0.5 * t for t in ids],
                 weight_versions=[(version, len(ids))], finish_reason=finish, shard=shard)


def drain(queue):
    out = []
    while queue:
        out.append(queue.take())
    return out


def test_a_choices_undelivered_deltas_become_one_merged_delta():
    queue = DeltaQueue()
    parts = [delta(0, [1], "a"), delta(0, [2, 3], "bc"), delta(0, [], ""), delta(0, [4], "d", finish="length")]
    for d in parts:
        queue.put(0, d)
    assert len(queue) == 1
    ((prompt, merged),) = drain(queue)
    assert prompt == 0 and merged.sample == 0
    assert merged.token_ids == [1, 2, 3, 4] and merged.text == "abcd"
    assert merged.logprobs == [-0.5, -1.0, -1.5, -2.0]
    assert merged.weight_versions == [(3, 4)] and merged.finish_reason == "length" and merged.shard == 0
    assert parts[0].token_ids == [1] and parts[0].text == "a"  # the caller's deltas are not changed


def test_choices_stay_apart_and_in_order_and_a_refit_shows_as_a_new_span():
    queue = DeltaQueue()
    queue.put(0, delta(0, [1], "a"))
    queue.put(0, delta(1, [7], "x"))
    queue.put(1, delta(0, [9], "z"))
    queue.put(0, delta(0, [2], "b", version=4))  # merged into prompt 0 sample 0's place, first
    queue.put(0, delta(1, [8], "y", finish="stop"))
    out = drain(queue)
    assert [(p, d.sample, d.token_ids, d.text) for p, d in out] == [(0, 0, [1, 2], "ab"), (0, 1, [7, 8], "xy"),
                                                                    (1, 0, [9], "z")]
    assert out[0][1].weight_versions == [(3, 1), (4, 1)] and out[1][1].finish_reason == "stop"


def test_a_taken_delta_is_not_merged_into_and_a_result_keeps_its_place():
    queue = DeltaQueue()
    queue.put(0, delta(0, [1], "a"))
    assert queue.take()[1].token_ids == [1]
    queue.put(0, delta(0, [2], "b"))  # after a take: a new delta, not the one already sent
    result, error = object(), RuntimeError("lost")
    queue.put(0, result)
    queue.put(0, delta(0, [3], "c"))  # after its prompt's result in the queue: queued behind it
    queue.put(1, error)
    assert [e if not isinstance(e, Delta) else e.token_ids for _, e in drain(queue)] == [[2], result, [3], error]
    with pytest.raises(IndexError):
        queue.take()


def test_a_long_backlog_keeps_every_piece_of_text():
    queue = DeltaQueue()
    for i in range(1000):
        queue.put(0, delta(0, [i % 50], str(i % 10)))
    ((_, merged),) = drain(queue)
    assert merged.text == "".join(str(i % 10) for i in range(1000)) and len(merged.token_ids) == 1000
    assert merged.weight_versions == [(3, 1000)]


def test_merged_deltas_keep_each_spans_digest():
    queue = DeltaQueue()
    for ids, version in (([1], 3), ([2], 3), ([5], 4)):
        d = delta(0, ids, "t", version=version)
        d.weight_digests = [f"wd1:v{version}"]
        queue.put(0, d)
    ((_, merged),) = drain(queue)
    assert merged.weight_versions == [(3, 2), (4, 1)]
    assert merged.weight_digests == ["wd1:v3", "wd1:v4"]  # one beside each span, in order
