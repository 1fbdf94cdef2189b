"""The fleet starts its HTTP server by name (``nemo_gen.fleet.services``), never by importing
``nemo_gen.server``: the installed package's entry point names the code, and a service asked for
that no package provides is refused naming the setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_gen.errors import ConfigError
from nemo_gen.fleet import services


def fleet_with(expose: bool):
    return SimpleNamespace(settings=SimpleNamespace(generation=SimpleNamespace(
        vllm_cfg=SimpleNamespace(expose_http_server=expose))))


def test_the_installed_package_provides_the_http_service():
    import nemo_gen.server

    assert services.provider(services.HTTP, "generation.vllm_cfg.expose_http_server") is nemo_gen.server.expose_http


def test_no_server_is_started_unless_the_setting_asks():
    assert services.start_http(fleet_with(False), tokenizer=None, on_failure=lambda: None) is None


def test_a_service_no_package_provides_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setattr(services, "entry_points", lambda group, name: [])
    with pytest.raises(ConfigError) as caught:
        services.start_http(fleet_with(True), tokenizer=None, on_failure=lambda: None)
    assert caught.value.field == "generation.vllm_cfg.expose_http_server"
    assert "nemo_gen.fleet_services" in str(caught.value)


def test_the_setting_reaches_the_server_with_the_fleets_failure_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(services, "provider", lambda name, field: lambda fleet, tok, on_failure: seen.append(
        (name, tok, on_failure)) or "handle")
    hook = object()
    assert services.start_http(fleet_with(True), tokenizer="tok", on_failure=hook) == "handle"
    assert seen == [("http", "tok", hook)]
