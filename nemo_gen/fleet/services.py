"""Services a fleet serves itself through while it runs — today the OpenAI-compatible HTTP server
(``generation.vllm_cfg.expose_http_server``) — found by name in the ``nemo_gen.fleet_services``
entry-point group (pyproject.toml). The server depends on the fleet, never the other way: the
driver side names the service, the package metadata says which code provides it.

A setting that asks for a service no installed package provides is refused by name, so it never
silently does nothing.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable

from nemo_gen.errors import ConfigError

GROUP = "nemo_gen.fleet_services"
HTTP = "http"


def provider(name: str, field: str) -> Callable[..., Any]:
    """The callable the installed packages register as service ``name``; ``field`` is the setting
    that asked for it (named in the error when none is installed)."""
    found = list(entry_points(group=GROUP, name=name))
    if not found:
        raise ConfigError(f"no {name!r} fleet service is installed (entry point group {GROUP!r} of the "
                          "nemo-gen package: reinstall it, e.g. `make setup`)", field=field)
    return found[0].load()


def start_http(fleet: Any, tokenizer: Any, on_failure: Callable[[], Any]) -> Any:
    """The fleet's own HTTP server when ``generation.vllm_cfg.expose_http_server`` is on, else None
    (``nemo_gen.server.expose_http``: on a failure to start, ``on_failure`` runs first)."""
    if not fleet.settings.generation.vllm_cfg.expose_http_server:
        return None
    return provider(HTTP, "generation.vllm_cfg.expose_http_server")(fleet, tokenizer, on_failure=on_failure)
