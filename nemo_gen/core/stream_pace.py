"""How often a stream hands out what its request made (``stream_interval_s``): the first token at
once, then at most one item per interval, the engine steps in between merged into it.

Each item costs the shard actor and the driver CPU (a Ray object, a chunk: a few hundred
microseconds, far more than a token's share of an engine step), so one per decode step would slow
the streams it serves. The interval grows with the streams an engine serves at once, so that a
shard's items per second stay bounded however many streams share its steps (the same steps would
otherwise cost one item per stream each); a reader still sees each token within the interval.
"""

from __future__ import annotations

STREAM_INTERVAL_S = 0.01  # the interval of a stream alone on its engine
STREAM_INTERVAL_PER_STREAM_S = 0.002  # added per stream open on the engine: ~500 items/s a shard at most
STREAM_INTERVAL_MAX_S = 0.1  # however many streams: a reader waits at most this long for a token


def stream_interval_s(streams: int) -> float:
    """How long a stream waits after an item while ``streams`` streams share its engine."""
    return min(STREAM_INTERVAL_MAX_S, max(STREAM_INTERVAL_S, streams * STREAM_INTERVAL_PER_STREAM_S))
