"""A stream's pace: one stream alone gets its items every STREAM_INTERVAL_S; many streams on one
engine get theirs further apart, so the engine's items per second stay bounded; never past the cap."""

from nemo_gen.core.stream_pace import (STREAM_INTERVAL_MAX_S, STREAM_INTERVAL_PER_STREAM_S, STREAM_INTERVAL_S,
                                       stream_interval_s)


def test_a_stream_alone_keeps_the_base_interval():
    assert stream_interval_s(0) == stream_interval_s(1) == STREAM_INTERVAL_S


def test_many_streams_bound_the_items_per_second_of_their_engine():
    for streams in (16, 32, 48):
        interval = stream_interval_s(streams)
        assert interval > STREAM_INTERVAL_S
        assert streams / interval <= 1 / STREAM_INTERVAL_PER_STREAM_S + 1e-6  # items a second, all streams


def test_the_interval_never_passes_its_cap():
    assert stream_interval_s(10_000) == STREAM_INTERVAL_MAX_S
    assert all(stream_interval_s(n) <= STREAM_INTERVAL_MAX_S for n in range(0, 2000, 7))
