"""Which load path a refit takes: the environment's override, and the run-time one that
benchmarks set on a running engine (``nemo_gen_set_load_path``)."""

from __future__ import annotations

import pytest

import nemo_gen.vllm_ext.worker_ext as ext


class Worker(ext.NemoGenWorkerExtension):
    def nemo_gen_load_path(self, target: str = "policy") -> str:
        return "reload_weights" if ext._forced_reload() else "direct"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(ext.FORCE_RELOAD_ENV, raising=False)
    yield
    ext._LOAD_PATH_OVERRIDE = None


def test_run_time_override_beats_the_environment(monkeypatch):
    w = Worker()
    assert w.nemo_gen_set_load_path("reload_weights") == "reload_weights"
    assert ext._forced_reload()
    monkeypatch.setenv(ext.FORCE_RELOAD_ENV, "reload_weights")
    assert w.nemo_gen_set_load_path("auto") == "direct"  # the run-time choice wins
    assert w.nemo_gen_set_load_path(None) == "reload_weights"  # back to the environment's


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="unknown load path 'fast'"):
        Worker().nemo_gen_set_load_path("fast")
    assert ext._LOAD_PATH_OVERRIDE is None
