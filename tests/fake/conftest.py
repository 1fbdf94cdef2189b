"""Fixtures of the fake tier: fleets and shards over tests/fakes.py (the real Shard rules over a
fake engine, the FakeDriver in place of Ray)."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_fleet_settings(make_settings):
    """Settings for a 2-shard fleet on the fake driver: no probes to wait for, restarts at once."""
    def make(**overrides):
        base = dict(fleet__name="fake", fleet__num_shards=2, health__probe_interval_s=60,
                    health__restart_backoff_s=0.0, health__restart_jitter=0.0, health__reap_timeout_s=0.1)
        base.update(overrides)
        return make_settings(**base)
    return make


@pytest.fixture
def driver():
    """A fresh ``tests.fakes.FakeDriver`` (the fake-driver tier's shards), closed after the test."""
    from tests.fakes import FakeDriver

    d = FakeDriver()
    yield d
    d.close()
