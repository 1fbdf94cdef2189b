"""/metrics over a real one-shard fleet of a vLLM CPU engine that keeps its stats (issue 31, item 2):
the vLLM series a scrape serves from the monitor's snapshot are the ones a direct call to the shard
gives (what every scrape used to make), and a scrape makes no such call."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nemo_gen import GenerationFleet

pytestmark = pytest.mark.engine


def _names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def test_metrics_serve_the_engines_vllm_series_without_calling_the_shard(ray_cluster, make_settings):
    from nemo_gen.server import start_server
    from nemo_gen.server.metrics import families_from_rows

    fleet = GenerationFleet.launch(make_settings(fleet__name="metrics-scrape", fleet__num_shards=1,
                                                 health__probe_interval_s=0.5,
                                                 generation__vllm_cfg__enable_vllm_metrics_logger=True))
    try:
        assert fleet.generate(["The quick brown fox", "Once upon a time"], max_new_tokens=4)[0].ok
        generated = time.monotonic()

        def fetched_since() -> bool:  # the monitor's snapshot was taken after the generation
            rows, age = fleet.monitor.vllm_stats().get(0, ([], float("inf")))
            return bool(rows) and age < time.monotonic() - generated

        deadline = generated + 30
        while not fetched_since():
            assert time.monotonic() < deadline, "the monitor fetched no vLLM stats"
            time.sleep(0.1)
        # what a scrape used to fetch itself: the shard's rows, over Ray, now
        direct = fleet.vllm_metrics()[0]

        class Direct:
            def collect(self):
                return list(families_from_rows(direct, {"shard": "0"}).values())

        registry = CollectorRegistry()
        registry.register(Direct())
        expected = _names(generate_latest(registry).decode())
        assert "vllm:num_requests_running" in expected and "vllm:prompt_tokens" in expected, sorted(expected)

        fleet.monitor.stop()  # its rounds are the only callers of driver.vllm_metrics
        calls = []
        fetch = fleet.driver.vllm_metrics
        fleet.driver.vllm_metrics = lambda handle: calls.append(handle) or fetch(handle)
        with start_server(fleet, port=0) as handle:
            text = httpx.get(f"{handle.url}/metrics", timeout=30).text
            httpx.get(f"{handle.url}/metrics", timeout=30)
        assert calls == []
        served = _names(text)
        assert {n for n in served if n.startswith("vllm:")} == expected
        assert {"nemo_gen_shards", "nemo_gen_weight_version", "nemo_gen_vllm_metrics_age_seconds",
                "nemo_gen_http_requests"} <= served
    finally:
        fleet.shutdown()
