"""``/metrics``: the fleet's series, each shard's vLLM series and the server's own, as Prometheus text.

A scrape makes no call to a shard: the fleet series are the fleet's own counts in this process,
the vLLM series the snapshot its monitor fetches on each probe round.

- fleet series from ``fleet.metrics()`` (NeMo-RL's ledger names, ``gen_fleet/...``) as Prometheus
  series with labels: ``gen_fleet/shards/healthy`` -> ``nemo_gen_shards{state="healthy"}``,
  ``gen_fleet/restart_attempts/0`` -> ``nemo_gen_restart_attempts_total{shard="0"}``,
  ``gen_fleet/weight_version`` -> ``nemo_gen_weight_version``; the fleet's running sums (restarts,
  re-routed requests, refits, refit seconds and bytes) are counters, the rest gauges. A key that
  already reads as a Prometheus name (``name{label="v"}``) is kept (``nemo_gen_`` prefixed).
- vLLM's own series from ``fleet.monitor.vllm_stats()`` (not ``fleet.vllm_metrics()``, which calls
  every shard) — per serving shard, the rows of vLLM's metrics snapshot in that shard's process
  (``vllm.v1.metrics.reader``: ``{"name", "labels", "kind": counter | gauge | histogram | vector,
  ...}``; Prometheus text or a ``{key: value}`` dict are read too) — under their own names
  (``vllm:num_requests_running``, ``vllm:prefix_cache_hits``, ...) with a ``shard`` label added,
  families merged across shards, and ``nemo_gen_vllm_metrics_age_seconds{shard}``: how long ago
  that shard's rows were fetched (they are as old as ``health.probe_interval_s`` at most while the
  shard answers). vLLM keeps them only with ``generation.vllm_cfg.enable_vllm_metrics_logger:
  true`` (`nemo-gen serve` turns it on), and the fleet fetches them only while its monitor runs
  (``health.enabled``; a fleet attached with ``watch=False`` has none).
- HTTP series of this server: ``nemo_gen_http_requests_total{route,code}`` and
  ``nemo_gen_http_request_duration_seconds{route}``; its admission: ``nemo_gen_server_in_flight``
  (samples held now against ``server.max_in_flight``, read at scrape time: a slot that is never
  given back shows here) and ``nemo_gen_server_max_in_flight``. ``route`` is a bounded set: the server's own
  paths, the gateway's as templates (``/nemo_gen/sessions/{id}/v1/chat/completions``: never a
  session's id, which would grow a series per session), anything else ``other``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics",
          "/nemo_gen/refit")
# The trajectory gateway's routes (nemo_gen.server.gateway) by what follows a session's id.
SESSIONS = "/nemo_gen/sessions"
SESSION_ROUTES = {tail: SESSIONS + "/{id}" + tail for tail in ("", "/v1/chat/completions", "/v1/models", "/trajectory")}
_KEY = re.compile(r"^(?P<name>[^{]+)(\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


# The fleet's running sums: counters in Prometheus (the rest of fleet.metrics() are gauges).
COUNTERS = frozenset({"restart_attempts", "rerouted_requests", "refits", "refit_seconds", "refit_bytes"})


def parse_key(key: str, prefix: str = "nemo_gen_") -> tuple[str, dict[str, str]]:
    """``'gen_fleet/shards/healthy'`` -> (``nemo_gen_shards``, ``{"state": "healthy"}``);
    ``'gen_fleet/shard_weight_version/1'`` -> (``nemo_gen_shard_weight_version``, ``{"shard": "1"}``);
    ``'vllm:num_requests_running{engine="0"}'`` (prefix "") -> as it is, labels parsed."""
    labels: dict[str, str] = {}
    if "/" in key and "{" not in key:
        parts = [p for p in key.split("/") if p]
        if parts and parts[0] == "gen_fleet":
            parts = parts[1:]
        if len(parts) >= 2 and parts[-1].isdigit():
            labels["shard"] = parts.pop()
        elif len(parts) == 2 and parts[0] == "shards":
            labels["state"] = parts.pop()
        name = "_".join(parts)
        if name in COUNTERS:
            name += "_total"
    else:
        match = _KEY.match(key.strip())
        name, raw = (match.group("name"), match.group("labels") or "") if match else (key, "")
        labels = {k: v.replace('\\"', '"') for k, v in _LABEL.findall(raw)}
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", name.strip())
    if prefix and not name.startswith(prefix.rstrip("_")):
        name = prefix + name
    if name[:1].isdigit():
        name = "_" + name
    return name, labels


def families_from_dict(values: Mapping[str, float], extra: Mapping[str, str] | None = None,
                       prefix: str = "nemo_gen_") -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for key, value in values.items():
        name, labels = parse_key(str(key), prefix)
        counter = name.endswith("_total")
        family = name.removesuffix("_total") if counter else name
        metric = out.get(family) or out.setdefault(
            family, Metric(family, f"nemo_gen fleet series {family}", "counter" if counter else "gauge"))
        metric.add_sample(name, {**labels, **(extra or {})}, float(value))
    return out


def families_from_text(text: str, extra: Mapping[str, str]) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for fam in text_string_to_metric_families(text):
        metric = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        for sample in fam.samples:
            metric.add_sample(sample.name, {**sample.labels, **extra}, sample.value, sample.timestamp)
        out[fam.name] = metric
    return out


def families_from_rows(rows: Iterable[Mapping[str, Any]], extra: Mapping[str, str]) -> dict[str, Metric]:
    """vLLM's metrics snapshot rows (``Engine.vllm_metrics``) as Prometheus families."""
    out: dict[str, Metric] = {}
    for row in rows:
        name, kind = str(row["name"]), row.get("kind")
        labels = {**{str(k): str(v) for k, v in (row.get("labels") or {}).items()}, **extra}
        typ = {"vector": "counter"}.get(kind, kind)
        if typ not in ("counter", "gauge", "histogram"):
            continue
        metric = out.get(name) or out.setdefault(name, Metric(name, f"vLLM {name}", typ))
        if kind == "counter":
            metric.add_sample(f"{name}_total", labels, float(row["value"]))
        elif kind == "gauge":
            metric.add_sample(name, labels, float(row["value"]))
        elif kind == "vector":  # one counter per position (vLLM's accepted tokens per position)
            for i, value in enumerate(row.get("values") or []):
                metric.add_sample(f"{name}_total", {**labels, "position": str(i)}, float(value))
        else:
            for le, count in (row.get("buckets") or {}).items():
                metric.add_sample(f"{name}_bucket", {**labels, "le": str(le)}, float(count))
            metric.add_sample(f"{name}_count", labels, float(row.get("count", 0)))
            metric.add_sample(f"{name}_sum", labels, float(row.get("sum", 0.0)))
    return out


def merge(into: dict[str, Metric], more: dict[str, Metric]) -> None:
    for name, metric in more.items():
        if name in into and into[name].type == metric.type:
            into[name].samples.extend(metric.samples)
        elif name not in into:
            into[name] = metric
        else:
            log.warning("metric %s is a %s and a %s; keeping the first", name, into[name].type, metric.type)


class _FleetCollector:
    def __init__(self, fleet: Any):
        self.fleet = fleet

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        try:
            merge(families, families_from_dict(self.fleet.metrics()))
        except Exception as exc:  # a scrape must not fail for one source
            log.warning("fleet.metrics() failed: %s", exc)
        snapshot = getattr(getattr(self.fleet, "monitor", None), "vllm_stats", None)
        per_shard: dict[Any, tuple[Any, float]] = {}
        try:
            per_shard = dict(snapshot() or {}) if callable(snapshot) else {}
        except Exception as exc:
            log.warning("the fleet's vLLM stats could not be read: %s", exc)
        ages = {str(shard): age for shard, (_, age) in per_shard.items()}
        if ages:
            merge(families, families_from_dict(
                {f'vllm_metrics_age_seconds{{shard="{shard}"}}': age for shard, age in ages.items()}))
        for shard, (stats, _) in per_shard.items():
            labels = {"shard": str(shard)}
            try:
                if isinstance(stats, str):
                    merge(families, families_from_text(stats, labels))
                elif isinstance(stats, Mapping):
                    merge(families, families_from_dict(stats, labels, prefix=""))
                else:
                    merge(families, families_from_rows(stats, labels))
            except Exception as exc:
                log.warning("vLLM metrics of shard %s could not be read: %s", shard, exc)
        return list(families.values())


class ServerMetrics:
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, fleet: Any, admission: Any = None):
        self.registry = CollectorRegistry(auto_describe=False)
        if admission is not None:  # the server's own bound (core.attempts.Admission), read when scraped
            Gauge("nemo_gen_server_in_flight", "samples the server holds now, against server.max_in_flight",
                  registry=self.registry).set_function(lambda: admission.held)
            if admission.limit is not None:
                Gauge("nemo_gen_server_max_in_flight", "server.max_in_flight: the samples the server holds at most",
                      registry=self.registry).set(admission.limit)
        self.requests = Counter("nemo_gen_http_requests", "HTTP requests served, by route and status code",
                                ["route", "code"], registry=self.registry)
        self.seconds = Histogram("nemo_gen_http_request_duration_seconds", "HTTP request time, by route",
                                 ["route"], registry=self.registry,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.registry.register(_FleetCollector(fleet))
        # the labelled children, looked up once: ``labels()`` takes a lock and checks its labels every time
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    @staticmethod
    def route(path: str) -> str:
        """The ``route`` label of a request path (a template for a session's: never its id)."""
        if path in ROUTES or path == SESSIONS:
            return path
        if path.startswith(SESSIONS + "/"):
            sid, slash, tail = path[len(SESSIONS) + 1:].partition("/")
            template = SESSION_ROUTES.get(slash + tail) if sid else None
            return template or "other"
        return "other"

    def observe(self, route: str, code: int, seconds: float) -> None:
        children = self._children.get((route, code))
        if children is None:  # a bounded set: the known routes and "other", times the status codes
            children = self._children[route, code] = (self.requests.labels(route, str(code)), self.seconds.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
