"""The managed Prefect server's own settings (nemo_gen.prefect_api.SERVER_ONLY_ENV): each key is
a setting Prefect reads, with the value meant; the services the UI needs stay on; only the
server's process gets them."""

from __future__ import annotations

import subprocess

import pytest

from nemo_gen import prefect_api
from nemo_gen.settings import NemoGenSettings


def _server_settings(monkeypatch, env: dict[str, str]):
    from prefect.settings.models.root import Settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings().server.services


def test_every_server_only_key_is_a_prefect_setting_read_as_meant(monkeypatch):
    services = _server_settings(monkeypatch, prefect_api.SERVER_ONLY_ENV)
    assert services.task_run_recorder.batch_size == 1000
    assert services.task_run_recorder.flush_interval == 1
    assert services.event_persister.batch_size == 1000
    assert not services.scheduler.enabled
    assert not services.late_runs.enabled
    assert not services.foreman.enabled


def test_the_services_the_ui_reads_from_stay_on(monkeypatch):
    services = _server_settings(monkeypatch, prefect_api.SERVER_ONLY_ENV)
    # Task runs (Prefect 3 writes them from client events), the event feed, automations.
    assert services.task_run_recorder.enabled
    assert services.event_persister.enabled
    assert services.triggers.enabled


def test_only_the_server_process_gets_them(monkeypatch, tmp_path):
    seen = {}

    class FakeProc:
        pid = 0

        def poll(self):
            return None

    def popen(cmd, env, **kwargs):
        seen.update(env)
        return FakeProc()

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(prefect_api, "_wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(prefect_api, "_flush_logs", lambda: None)
    monkeypatch.setattr(prefect_api, "_stop", lambda proc: None)
    settings = NemoGenSettings.load(overrides={"home": str(tmp_path)})
    with prefect_api.prefect_api(settings) as api:
        import os

        assert api.managed
        for key in prefect_api.SERVER_ONLY_ENV:
            assert key not in os.environ
    for key, value in prefect_api.SERVER_ONLY_ENV.items():
        assert seen[key] == value
    assert seen["PREFECT_HOME"] == str((tmp_path / "prefect").resolve())


@pytest.mark.parametrize("url", [None, "http://127.0.0.1:4200/api"])
def test_client_env_has_no_server_only_keys(tmp_path, url):
    env = prefect_api.server_env(tmp_path, url)
    assert not set(env) & set(prefect_api.SERVER_ONLY_ENV)
    assert env.get("PREFECT_API_URL") == url
