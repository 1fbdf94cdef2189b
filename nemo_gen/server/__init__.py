"""An OpenAI-compatible HTTP server in front of a ``GenerationFleet`` (``nemo-gen serve``, and the
fleet itself with ``generation.vllm_cfg.expose_http_server: true``).

    from nemo_gen.server import start_server
    handle = start_server(fleet)          # server.host / server.port of the fleet's settings
    print(handle.url)                     # http://127.0.0.1:8000 — /v1/completions, /v1/chat/completions, ...
    handle.stop()

Routes, headers and errors: ``nemo_gen.server.app``; request and response translation on vLLM's
protocol models: ``nemo_gen.server.protocol``; ``/metrics``: ``nemo_gen.server.metrics``.
Importing this package starts nothing and imports neither vLLM nor uvicorn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["start_server", "ServerHandle"]


def start_server(fleet: Any, settings: Any = None, host: str | None = None, port: int | None = None,
                 tokenizer: Any = None):
    """See ``nemo_gen.server.runner.start_server``."""
    from nemo_gen.server.runner import start_server as start

    return start(fleet, settings, host=host, port=port, tokenizer=tokenizer)


def __getattr__(name: str) -> Any:
    if name == "ServerHandle":
        from nemo_gen.server.runner import ServerHandle

        return ServerHandle
    raise AttributeError(name)
