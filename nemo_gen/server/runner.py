"""``start_server``: the app on uvicorn in a background thread of this process, beside the fleet.

The listening socket is bound in the caller's thread, so a port that is taken fails right there
(``ConfigError`` naming ``server.port``) and port 0 is resolved before ``start_server`` returns;
the thread runs uvicorn's own event loop (uvicorn leaves signals to the main thread). The heap
that exists at start is frozen out of the garbage collector (``gc.freeze``, as vLLM's server does). ``stop()``
lets requests in flight finish (up to ``grace_s``), then closes the socket and joins the thread.
Connections are bounded: ``server.header_timeout_s`` for a request's headers
(``nemo_gen.server.connections``), ``server.keep_alive_s`` between requests, ``server.max_connections``
at once (uvicorn answers 503 past it).

A host other than a loopback address without ``server.api_key`` is warned about once, at start, and
refused with ``server.allow_refit`` (as settings refuse it; here for a ``host=`` argument too).
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nemo_gen.errors import ConfigError
from nemo_gen.settings import exposure_problem, is_loopback

log = logging.getLogger(__name__)

# How long stop() lets requests in flight finish before uvicorn cancels them.
GRACE_S = 5.0
_START_TIMEOUT_S = 30.0


@dataclass
class ServerHandle:
    """A running server: ``url`` (``http://host:port``), ``stop()`` (idempotent)."""

    url: str
    host: str
    port: int
    server: Any = field(repr=False)
    thread: threading.Thread = field(repr=False)
    on_stop: Callable[[], None] | None = field(default=None, repr=False)  # the gateway lets go of its directory

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout_s: float = GRACE_S + 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(2.0)
        if self.thread.is_alive():  # pragma: no cover - uvicorn ignored both
            log.warning("the HTTP server thread did not stop within %.0fs", timeout_s + 2.0)
        if self.on_stop is not None:
            self.on_stop()
            self.on_stop = None
        gc.unfreeze()  # back in the collector's view, so the interpreter's exit frees it as usual

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve {host!r}: {exc.strerror}", field="server.host") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="server.port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def freeze_heap() -> None:
    """As vLLM's own server does after start: what the process holds now (torch, transformers,
    vLLM, Ray: millions of objects) leaves the collector's view, since a full collection over it
    takes ~0.4 s and a server's allocations set one off every few hundred requests. The young
    generations are collected first, as vLLM's ``freeze_gc_heap`` does, but not the old one: that
    is itself a walk of the whole heap, paid again by every start in a process that starts servers
    one after another (a loop that serves between steps, the fast tier's fifty-odd servers). Old
    garbage it would have found stays until ``stop()`` unfreezes the heap."""
    gc.collect(0)
    gc.collect(1)
    gc.freeze()


def start_server(fleet: Any, settings: Any = None, host: str | None = None, port: int | None = None,
                 tokenizer: Any = None) -> ServerHandle:
    """Serve ``fleet`` over OpenAI's HTTP API (``nemo_gen.server.app``) at ``server.host`` /
    ``server.port`` of ``settings`` (default: the fleet's settings; ``host`` / ``port`` override
    them). Returns once the server accepts connections. ``tokenizer``: the fleet's, for token
    strings and stream pieces (default: loaded from the fleet's tokenizer directory)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from nemo_gen.server.app import build_app
    from nemo_gen.server.connections import header_deadline

    settings = settings or fleet.settings
    host = settings.server.host if host is None else host
    port = settings.server.port if port is None else port
    why = exposure_problem(host, settings.server.allow_refit, settings.server.api_key)
    if why:
        raise ConfigError(why, field="server.allow_refit")
    if tokenizer is None:
        tokenizer = getattr(fleet, "tokenizer", None)
    if tokenizer is None:
        from nemo_gen.fleet.resolve import load_tokenizer

        tokenizer = load_tokenizer(fleet.resolved.tokenizer_dir)
    sock = _bind(host, port)  # a taken port is named before the gateway takes its sessions directory
    try:
        app = build_app(fleet, settings, tokenizer)
    except BaseException:
        sock.close()
        raise
    gateway = app.app.state.gateway

    def close_gateway() -> None:  # what the app holds: its sessions directory, its tokenizing threads
        gateway.close()
        gateway.api.tokens.close()

    freeze_heap()
    bound_host, bound_port = sock.getsockname()[:2]
    bounds = settings.server
    # uvicorn's own bounds (between requests, and connections at once) and ours on request headers
    http = header_deadline(AutoHTTPProtocol, bounds.header_timeout_s)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http=http,
                            timeout_graceful_shutdown=GRACE_S, timeout_keep_alive=bounds.keep_alive_s,
                            limit_concurrency=bounds.max_connections)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # pragma: no cover - reported to start_server's caller
            errors.append(exc)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name="nemo-gen-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(2.0)
            close_gateway()
            raise RuntimeError(f"the HTTP server did not start: {errors[0] if errors else 'timed out'}")
        time.sleep(0.01)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    handle = ServerHandle(url=f"http://{shown}:{bound_port}", host=bound_host, port=bound_port,
                          server=server, thread=thread, on_stop=close_gateway)
    log.info("OpenAI-compatible server for fleet %r at %s", getattr(settings.fleet, "name", "?"), handle.url)
    if not settings.server.api_key and not is_loopback(host):
        log.warning("the server at %s (server.host %r) can be reached from other machines and asks no key: "
                    "anyone who reaches it can generate; set server.api_key, or bind server.host to 127.0.0.1",
                    handle.url, host)
    return handle
