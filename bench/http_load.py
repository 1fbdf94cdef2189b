"""A closed-loop HTTP load generator and a /health prober, each run in a process of its own so
that neither shares an interpreter with the server it measures (bench/overload.py runs them).

    python -m bench.http_load '{"mode": "load", "url": ..., "model": ..., "clients": 64, "window_s": 20, ...}'
    python -m bench.http_load '{"mode": "health", "url": ..., "window_s": 20, "interval_s": 0.01}'

``load``: ``clients`` workers, each on its own keep-alive connection, send a completion, wait for
its answer, and send the next, until ``window_s`` has passed (closed loop: the offered load is the
number of clients). A 503 is waited out for its ``Retry-After`` (capped at ``max_backoff_s``)
before that worker's next request, as a well-behaved client does. ``stream: true`` reads
server-sent events to ``[DONE]``. Every request is answered or counted as hung (no answer within
``timeout_s``) or lost (the connection broke). Prints one JSON line: statuses, tokens of the 200s,
latencies, sent/answered/hung/lost. ``prompt_chars``: one request with a prompt of that many
characters is sent at the start of the window (the 4 MB prompt of the /health check).

``health``: ``GET /health`` every ``interval_s`` on one keep-alive connection for ``window_s``;
prints each answer's latency and status.

``abuse``: the clients a public endpoint meets beside the well-behaved ones, for ``window_s``, each
kind on its own connections (``kinds``, default all four), ``per_kind`` workers of each, a streaming
worker starting its next request ``pace_s`` after its last ended (careless clients, not a flood: an
abandoned stream is real engine work until its abort lands):
- ``abandon``: a streamed ``n=2`` request read for a few events, then the connection closed (an
  openai client's ``break`` out of a stream); a 503 is waited out for its Retry-After, as the
  openai client does;
- ``stall``: a streamed request whose reader takes the headers and then stops reading with its
  socket open, for ``stall_s``, then closes;
- ``half_header``: ``half_headers`` connections that send half a request header and nothing more;
  each is watched for the server closing it;
- ``poison``: a prompt of token ids past the vocabulary (``vocab_size``), twice a second: must be a
  4xx (or a 503 while the server is full), never an engine's death.
Prints one JSON line: per kind, how many were sent and the statuses seen; for ``half_header``, how
many the server closed within the window and after how long.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit


def _request(url: Any, path: str, body: dict[str, Any] | None) -> bytes:
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head + data


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case), body (by Content-Length or chunked)."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("the server closed the connection")
    status = int(line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return status, headers, b"".join(parts)
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def _tokens(body: bytes, stream: bool) -> int:
    if not stream:
        return json.loads(body)["usage"]["completion_tokens"]
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: {")]
    if any("error" in e for e in events):
        raise RuntimeError(f"the stream ended with an error: {next(e for e in events if 'error' in e)}")
    return next(e["usage"]["completion_tokens"] for e in reversed(events) if e.get("usage"))


async def _load(job: dict[str, Any]) -> dict[str, Any]:
    url = urlsplit(job["url"])
    end = time.monotonic() + job["window_s"]
    out: dict[str, Any] = {"statuses": {}, "tokens": 0, "sent": 0, "answered": 0, "hung": 0, "lost": 0,
                           "latency_s": [], "errors": []}
    body = {"model": job["model"], "max_tokens": job["max_tokens"], "temperature": 0, "ignore_eos": True,
            "stream": bool(job.get("stream"))}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}

    async def one(i: int, reader, writer, request_body) -> float:
        """Send one request, read its answer; the seconds to wait before the next."""
        writer.write(_request(url, "/v1/completions", request_body))
        out["sent"] += 1
        t0 = time.monotonic()
        status, headers, data = await asyncio.wait_for(_response(reader), job["timeout_s"])
        out["answered"] += 1
        out["statuses"][str(status)] = out["statuses"].get(str(status), 0) + 1
        if status == 200:
            out["latency_s"].append(time.monotonic() - t0)
            out["tokens"] += _tokens(data, request_body["stream"])
            return 0.0
        if len(out["errors"]) < 5:
            out["errors"].append({"status": status, "body": data[:300].decode(errors="replace")})
        if status == 503:
            return min(float(headers.get("retry-after", "1")), job.get("max_backoff_s", 1.0))
        return 0.0

    async def worker(i: int) -> None:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        n = 0
        try:
            while time.monotonic() < end:
                n += 1
                try:
                    wait = await one(i, reader, writer, {**body, "prompt": f"client {i} request {n}: once upon a time"})
                except asyncio.TimeoutError:
                    out["hung"] += 1
                    return
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    out["lost"] += 1
                    out["errors"].append({"status": None, "body": f"{type(exc).__name__}: {exc}"})
                    return
                if wait:
                    await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))
        finally:
            writer.close()

    async def big_prompt() -> None:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            text = ("lorem ipsum dolor " * (job["prompt_chars"] // 18 + 1))[: job["prompt_chars"]]
            writer.write(_request(url, "/v1/completions", {"model": job["model"], "prompt": text, "max_tokens": 4}))
            t0 = time.monotonic()
            status, _, data = await asyncio.wait_for(_response(reader), job["timeout_s"])
            out["big_prompt"] = {"status": status, "seconds": time.monotonic() - t0,
                                 "answer": data[:200].decode(errors="replace")}
        finally:
            writer.close()

    tasks = [worker(i) for i in range(job["clients"])]
    if job.get("prompt_chars"):
        tasks.append(big_prompt())
    t0 = time.monotonic()
    await asyncio.gather(*tasks)
    out["wall_s"] = time.monotonic() - t0
    return out


async def _health(job: dict[str, Any]) -> dict[str, Any]:
    url = urlsplit(job["url"])
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    end = time.monotonic() + job["window_s"]
    latencies, statuses = [], {}
    while time.monotonic() < end:
        t0 = time.monotonic()
        writer.write(_request(url, "/health", None))
        status, _, _ = await _response(reader)
        latencies.append(time.monotonic() - t0)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        await asyncio.sleep(job["interval_s"])
    writer.close()
    return {"latency_s": latencies, "statuses": statuses}


ABUSE_KINDS = ("abandon", "stall", "half_header", "poison")


async def _abuse(job: dict[str, Any]) -> dict[str, Any]:
    url = urlsplit(job["url"])
    end = time.monotonic() + job["window_s"]
    kinds = job.get("kinds") or ABUSE_KINDS
    out: dict[str, Any] = {k: {"sent": 0, "statuses": {}} for k in kinds}

    def seen(kind: str, status: int | None) -> None:
        out[kind]["statuses"][str(status)] = out[kind]["statuses"].get(str(status), 0) + 1

    def stream_body(n: int) -> dict[str, Any]:
        return {"model": job["model"], "prompt": "a story that never ends", "n": n, "max_tokens": job.get(
            "long_tokens", 200), "temperature": 1.0, "ignore_eos": True, "stream": True}

    async def head(reader: asyncio.StreamReader) -> int:
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        return status

    async def abandon() -> None:
        while time.monotonic() < end:
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            try:
                writer.write(_request(url, "/v1/completions", stream_body(2)))
                out["abandon"]["sent"] += 1
                status = await asyncio.wait_for(head(reader), 60)
                seen("abandon", status)
                if status == 200:  # a few events' worth of the chunked body, then gone
                    await asyncio.wait_for(reader.read(256), 60)
            except (ConnectionError, asyncio.TimeoutError, ValueError, IndexError):
                status = None
                seen("abandon", None)
            finally:
                writer.close()
            await asyncio.sleep(max(job.get("pace_s", 1.0), 1.0 if status == 503 else 0.0))

    async def stall() -> None:
        while time.monotonic() < end:
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            try:
                writer.write(_request(url, "/v1/completions", stream_body(4)))
                out["stall"]["sent"] += 1
                seen("stall", await asyncio.wait_for(head(reader), 60))
                await asyncio.sleep(min(job.get("stall_s", 10.0), max(0.0, end - time.monotonic())))
            except (ConnectionError, asyncio.TimeoutError, ValueError, IndexError):
                seen("stall", None)
            finally:
                writer.close()
            await asyncio.sleep(job.get("pace_s", 1.0))

    async def half_header() -> None:
        opened = []
        for _ in range(job.get("half_headers", 50)):
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Ty".encode())
            opened.append((time.monotonic(), reader, writer))
        out["half_header"]["sent"] = len(opened)
        closed_after = []

        async def watch(t0: float, reader: asyncio.StreamReader) -> None:
            try:  # the server's answer (a 408, or nothing) and its close
                await asyncio.wait_for(reader.read(), max(0.0, end - time.monotonic()))
                closed_after.append(time.monotonic() - t0)
            except (asyncio.TimeoutError, ConnectionError):
                pass

        await asyncio.gather(*(watch(t0, r) for t0, r, _ in opened))
        for _, _, writer in opened:
            writer.close()
        out["half_header"].update(closed=len(closed_after), closed_after_max_s=max(closed_after, default=None))

    async def poison() -> None:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            while time.monotonic() < end:
                ids = [1, 2, job["vocab_size"] + 7]
                writer.write(_request(url, "/v1/completions", {"model": job["model"], "prompt": ids, "max_tokens": 4}))
                out["poison"]["sent"] += 1
                status, _, data = await asyncio.wait_for(_response(reader), 60)
                seen("poison", status)
                if status != 503:
                    out["poison"].setdefault("answer", data[:300].decode(errors="replace"))
                await asyncio.sleep(0.5)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            seen("poison", None)
        finally:
            writer.close()

    runs = {"abandon": abandon, "stall": stall, "half_header": half_header, "poison": poison}
    workers = [runs[k]() for k in kinds for _ in range(job.get("per_kind", 2) if k != "half_header" else 1)]
    await asyncio.gather(*workers)
    return out


def main(argv: list[str] | None = None) -> None:
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    modes = {"load": _load, "health": _health, "abuse": _abuse}
    result = asyncio.run(modes[job["mode"]](job))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
