"""An OpenAI-compatible HTTP server in front of a ``GenerationFleet`` (``nemo-gen serve``, and a
fleet with ``generation.vllm_cfg.expose_http_server: true`` composed with its server: ``serve``).

    from nemo_gen.server import start_server
    handle = start_server(fleet)          # server.host / server.port of the fleet's settings
    print(handle.url)                     # http://127.0.0.1:8000 — /v1/completions, /v1/chat/completions, ...
    handle.stop()

A fleet with ``generation.vllm_cfg.expose_http_server: true`` gets one where the process is composed
(``serve(fleet)``: ``fleet.http_url``); the fleet never starts it itself. Routes, headers and errors: ``nemo_gen.server.app``; request and response
translation on vLLM's protocol models: ``nemo_gen.server.protocol``; ``/metrics``:
``nemo_gen.server.metrics``.
Importing this package starts nothing and imports neither vLLM nor uvicorn.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["start_server", "expose_http", "serve", "ServerHandle"]


def start_server(fleet: Any, settings: Any = None, host: str | None = None, port: int | None = None,
                 tokenizer: Any = None):
    """See ``nemo_gen.server.runner.start_server``."""
    from nemo_gen.server.runner import start_server as start

    return start(fleet, settings, host=host, port=port, tokenizer=tokenizer)


def serve(fleet: Any, attached: bool = False) -> Any:
    """``fleet`` with its own server when ``generation.vllm_cfg.expose_http_server`` is on, kept as
    ``fleet.http`` (``fleet.http_url``; stopped with the fleet): wired where the process is composed
    (``nemo-gen serve``, the pipeline's launch task, NeMo-RL's ``VllmGeneration``, a test's fleet),
    never from inside the fleet. A server that cannot start shuts the fleet down (detaches it, when
    ``attached``) before the error is raised. Returns ``fleet``."""
    fleet.http = expose_http(fleet, fleet.router.tokenizer, on_failure=fleet.detach if attached else fleet.shutdown)
    return fleet


def expose_http(fleet: Any, tokenizer: Any = None, on_failure: Callable[[], Any] | None = None):
    """The fleet's own server (``serve`` calls this once the fleet is up): ``start_server`` on
    the fleet's settings when ``generation.vllm_cfg.expose_http_server`` is true, else None. When
    the server cannot start (``server.port`` taken), ``on_failure`` runs (the fleet's shutdown, or
    detach for an attached fleet) before the error is raised: nothing is left half up."""
    if not fleet.settings.generation.vllm_cfg.expose_http_server:
        return None
    try:
        return start_server(fleet, tokenizer=tokenizer)
    except BaseException:
        if on_failure is not None:
            on_failure()
        raise


def __getattr__(name: str) -> Any:
    if name == "ServerHandle":
        from nemo_gen.server.runner import ServerHandle

        return ServerHandle
    raise AttributeError(name)
