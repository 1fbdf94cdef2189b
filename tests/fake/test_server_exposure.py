"""The server at the trust boundary (issue 31, item 2), over fake shards (tests/fakes.py): a host
beyond this machine without a key is warned about once at start, and refused with the refit route;
a /metrics scrape makes no call to a shard (the vLLM series are the monitor's snapshot, with its age)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nemo_gen.errors import ConfigError
from tests.fakes import CountingDriver, FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _exposure_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("nemo_gen.server") and "server.api_key" in r.getMessage()]


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, 1), ("0.0.0.0", "s3cret", 0), ("127.0.0.1", None, 0)])
def test_a_server_reachable_from_elsewhere_without_a_key_is_warned_about_once_at_start(make_settings, caplog,
                                                                                      host, key, warned):
    from nemo_gen.server import start_server

    driver = FakeDriver()
    settings = make_settings(fleet__name="fake-exposed", fleet__num_shards=1, health__probe_interval_s=60,
                             server__host=host, server__port=0, **({"server__api_key": key} if key else {}))
    fleet = fake_fleet(settings, driver)
    try:
        with caplog.at_level(logging.WARNING, logger="nemo_gen"):
            with start_server(fleet) as handle:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                for _ in range(3):  # requests add no warning: it is the start's
                    assert httpx.get(f"http://127.0.0.1:{handle.port}/health").status_code == 200
                    assert httpx.get(f"http://127.0.0.1:{handle.port}/v1/models", headers=headers).status_code == 200
        messages = _exposure_warnings(caplog)
        assert len(messages) == warned, messages
        if warned:
            assert "'0.0.0.0'" in messages[0] and "127.0.0.1" in messages[0]
    finally:
        fleet.shutdown()
        driver.close()


def test_a_host_argument_cannot_open_the_refit_route_beyond_this_machine_without_a_key(make_settings):
    """Settings refuse server.host 0.0.0.0 with allow_refit and no key; start_server's host= must
    not get around that."""
    from nemo_gen.server import start_server

    driver = FakeDriver()
    settings = make_settings(fleet__name="fake-host-arg", fleet__num_shards=1, health__probe_interval_s=60,
                             server__allow_refit=True, server__port=0)
    fleet = fake_fleet(settings, driver)
    try:
        with pytest.raises(ConfigError) as err:
            start_server(fleet, host="0.0.0.0")
        assert err.value.field == "server.allow_refit" and "server.api_key" in str(err.value)
        with start_server(fleet, host="127.0.0.1") as handle:  # loopback: the route is served
            assert httpx.post(f"{handle.url}/nemo_gen/refit", json={}).status_code == 400
    finally:
        fleet.shutdown()
        driver.close()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _vllm_shards(families: dict) -> set[str]:
    return {s.labels.get("shard") for name, f in families.items() if name.startswith("vllm:") for s in f.samples}


def _served(families: dict) -> float:
    family = families.get("vllm:request_success")
    return sum(s.value for s in family.samples if s.name.endswith("_total")) if family else 0


def _fetched_after_the_completion(families: dict) -> bool:
    return _vllm_shards(families) == {"0", "1"} and _served(families) == 1


def test_a_metrics_scrape_makes_no_call_to_a_shard(make_settings):
    """/metrics keeps its series — the fleet's, each shard's vLLM series, the HTTP ones — but reads
    the vLLM ones from what the monitor fetched on its probe rounds: with the monitor stopped,
    scrapes go on serving them (older each time) and the driver sees no call at all."""
    from nemo_gen.server import start_server

    driver = CountingDriver()
    settings = make_settings(fleet__name="fake-scrape", fleet__num_shards=2, health__probe_interval_s=0.05,
                             generation__vllm_cfg__enable_vllm_metrics_logger=True, server__port=0)
    fleet = fake_fleet(settings, driver)
    try:
        with start_server(fleet) as handle:
            assert httpx.post(f"{handle.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
            deadline = time.monotonic() + 10
            while not _fetched_after_the_completion(_families(httpx.get(f"{handle.url}/metrics").text)):
                assert time.monotonic() < deadline, "no vLLM series for both shards since the completion"
                time.sleep(0.05)
            fleet.monitor.stop()  # from here on, nothing but the scrapes below may call the driver
            before = dict(driver.counts)
            first = _families(httpx.get(f"{handle.url}/metrics").text)
            time.sleep(0.3)
            texts = [httpx.get(f"{handle.url}/metrics").text for _ in range(10)]
            assert dict(driver.counts) == before  # not one call, over 11 scrapes
    finally:
        fleet.shutdown()
        driver.close()
    last = _families(texts[-1])
    # the content: fleet series, vLLM series per shard (with the fake engine's values), HTTP series
    assert {s.labels["state"]: s.value for s in last["nemo_gen_shards"].samples}["healthy"] == 2
    assert "nemo_gen_weight_version" in last and last["nemo_gen_rerouted_requests"].type == "counter"
    assert _vllm_shards(last) == {"0", "1"}
    assert last["vllm:num_requests_running"].type == "gauge"
    assert last["vllm:time_to_first_token_seconds"].type == "histogram"
    assert _served(last) == 1  # the one completion, as the shard that ran it counted it
    assert any(s.labels.get("route") == "/metrics" for s in last["nemo_gen_http_requests"].samples)
    # and how old each shard's snapshot is: it grows while nobody fetches
    age = {s.labels["shard"]: s.value for s in first["nemo_gen_vllm_metrics_age_seconds"].samples}
    later = {s.labels["shard"]: s.value for s in last["nemo_gen_vllm_metrics_age_seconds"].samples}
    assert set(age) == {"0", "1"} and all(later[k] >= age[k] + 0.25 for k in age), (age, later)


def test_the_vllm_stats_snapshot_is_the_serving_actors_own():
    """A slot's stats are kept with the actor that sent them: a replacement does not inherit its
    predecessor's counters; a fetch that fails leaves the last snapshot to age."""
    from nemo_gen.fleet.monitor import VllmStats
    from nemo_gen.fleet.handles import ShardHandle

    class Driver:
        fail = False

        def vllm_metrics(self, handle):
            if self.fail:
                raise RuntimeError("gone")
            return [{"name": "vllm:x", "labels": {}, "kind": "gauge", "value": handle.name}]

    driver = Driver()
    stats = VllmStats(driver, "t")
    old = ShardHandle(index=0, name="a-shard-0", actor=None, placement_group=None, info={})
    try:
        stats.refresh({0: old})
        deadline = time.monotonic() + 5
        while not stats.snapshot({0: old.name}):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (rows, age), = stats.snapshot({0: old.name}).values()
        assert rows[0]["value"] == "a-shard-0" and 0 <= age < 5
        assert stats.snapshot({0: "a-shard-0-r1"}) == {}  # slot 0 is now another actor's
        assert stats.snapshot({}) == {}  # slot 0 serves no more
        driver.fail = True
        stats.refresh({0: old})
        time.sleep(0.2)
        (rows, later), = stats.snapshot({0: old.name}).values()
        assert rows[0]["value"] == "a-shard-0" and later >= age + 0.2
    finally:
        stats.close()
