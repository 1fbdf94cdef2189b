"""The fleet record's writer (``nemo_gen.fleet.record.RecordWriter``) against a real record actor on
the session's Ray cluster (no engine): a write leaves the caller's thread at once, and the writes
land in the order they were made; this process reads its own writes through ``find_record``;
``close`` ends the sending thread; a write to a record that is gone is logged, never raised."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from nemo_gen.core.wire import SlotRecord
from nemo_gen.fleet.record import RecordWriter, create_record, find_record, remove_record
from tests.conftest import TEST_NAMESPACE

pytestmark = pytest.mark.engine


class _Spy:
    """The record actor's handle, noting which thread submitted each call."""

    def __init__(self, actor):
        self.threads: list[threading.Thread] = []
        self.set_version = self._method(actor.set_version)
        self.set_slot = self._method(actor.set_slot)

    def _method(self, method):
        spy = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                spy.threads.append(threading.current_thread())
                return method.remote(*args, **kwargs)

        return Method


@pytest.fixture
def record(ray_cluster):
    name = f"rec-{uuid.uuid4().hex[:8]}"
    actor = create_record(name, TEST_NAMESPACE, None, 60)
    yield name, actor
    remove_record(actor)


def test_writes_leave_the_callers_thread_land_in_order_and_are_read_back(record):
    name, actor = record
    spy = _Spy(actor)
    writer = RecordWriter(spy, 30, key=(TEST_NAMESPACE, name))
    t0 = time.perf_counter()
    for v in range(1, 51):
        writer.write_version(v, f"ckpt-{v}")
        writer.write_slot(v % 2, v, None)
    asked_s = time.perf_counter() - t0
    # this process's writes are in the record before find_record reads it, the last ones last
    _, data = find_record(name, TEST_NAMESPACE, 30)
    assert data.weight_version == 50 and data.weight_source == "ckpt-50"
    assert data.slots == (SlotRecord(0, restarts=50), SlotRecord(1, restarts=49))
    assert len(spy.threads) == 100 and {t.name for t in spy.threads} == {"nemo-gen-record"}
    assert threading.current_thread() not in spy.threads
    assert asked_s < 1.0, f"100 writes kept the caller {asked_s:.2f}s"  # queued, not submitted, here
    sender = spy.threads[0]
    writer.close()
    sender.join(10)
    assert not sender.is_alive()
    writer.write_version(51, None)  # a write after close starts another thread
    writer.close()
    assert find_record(name, TEST_NAMESPACE, 30)[1].weight_version == 51
    assert spy.threads[-1] is not sender


def test_a_write_to_a_record_that_is_gone_is_logged_not_raised(record, caplog):
    name, actor = record
    writer = RecordWriter(actor, 10, key=(TEST_NAMESPACE, name))
    remove_record(actor)
    with caplog.at_level(logging.WARNING, logger="nemo_gen.fleet.record"):
        writer.write_version(3, None)
        t0 = time.monotonic()
        writer.close()
    assert time.monotonic() - t0 < 15
    assert "could not update the fleet record" in caplog.text
    assert find_record(name, TEST_NAMESPACE, 10) == (None, None)
