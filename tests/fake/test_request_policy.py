"""A request's own weight policy (``min_version``, ``max_staleness``; nemo_gen.core.request_policy):
the rule in milliseconds, then the fleet (fake tier) and its HTTP server refusing what they
cannot honour, naming the field, and serving what they can, with the weight digest beside each
version span."""

from __future__ import annotations

import httpx
import pytest
import torch

from nemo_gen.core.request_policy import RequestPolicy, honour, refusal, split_policy, staleness_bound
from nemo_gen.core.wire import InFlight
from nemo_gen.errors import RequestError
from tests.fakes import fake_fleet
from tests.helpers import served_fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DRAIN, ABORT = InFlight("drain"), InFlight("abort")
KEEP_8, KEEP_ANY, KEEP_RECOMPUTE = InFlight("keep", max_staleness=8), InFlight("keep"), InFlight("keep", recompute_kv=True)


def test_policy_keywords_are_split_off_and_checked_by_name():
    policy, rest = split_policy({"min_version": 3, "temperature": 0.5})
    assert policy == RequestPolicy(min_version=3) and rest == {"temperature": 0.5}
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(RequestError, match=r"^max_staleness: a whole number >= 0"):
            split_policy({"max_staleness": bad})


@pytest.mark.parametrize("in_flight, bound", [(DRAIN, 0), (ABORT, 0), (KEEP_8, 8), (KEEP_ANY, None),
                                              (KEEP_RECOMPUTE, 0)])
def test_how_stale_a_running_request_can_get_per_refit_mode(in_flight, bound):
    assert staleness_bound(in_flight) == bound


def test_min_version_is_honoured_from_that_version_on():
    assert refusal(RequestPolicy(min_version=3), 3, DRAIN) is None
    assert refusal(RequestPolicy(min_version=3), 4, DRAIN) is None
    assert refusal(RequestPolicy(min_version=3), 2, DRAIN).startswith("min_version: the fleet serves weight version 2")
    assert "no weight version yet" in refusal(RequestPolicy(min_version=0), None, DRAIN)


def test_max_staleness_is_honoured_where_refits_bound_it():
    assert refusal(RequestPolicy(max_staleness=0), None, DRAIN) is None
    assert refusal(RequestPolicy(max_staleness=0), 1, ABORT) is None
    assert refusal(RequestPolicy(max_staleness=8), 1, KEEP_8) is None
    assert refusal(RequestPolicy(max_staleness=4), 1, KEEP_8).startswith("max_staleness: ")
    assert "any number of" in refusal(RequestPolicy(max_staleness=100), 1, KEEP_ANY)
    with pytest.raises(RequestError, match="^max_staleness: .*up to 8 tokens"):
        honour({"max_staleness": 2}, 1, KEEP_8)


def _refit(fleet):
    return fleet.refit({"w": torch.ones(4, 4), "b": torch.zeros(4)})


def test_the_fleet_refuses_naming_the_field_and_serves_what_it_honours(fake_fleet_settings, driver, tmp_path):
    with fake_fleet(fake_fleet_settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        with pytest.raises(RequestError, match="^min_version: the fleet serves weight version 0"):
            fleet.generate([[5, 6]], min_version=1)
        report = _refit(fleet)
        (r,) = fleet.generate([[5, 6]], min_version=1, max_staleness=0)  # drain: never stale
        assert r.weight_versions == [(1, len(r.token_ids))] and r.weight_digests == [report.digest]
        with pytest.raises(RequestError, match="^min_version"):
            fleet.generate([[5, 6]], min_version=2)


def test_keep_refits_bound_what_max_staleness_may_ask(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(refit__staging_dir=str(tmp_path), refit__in_flight="keep", refit__max_staleness=8)
    with fake_fleet(settings, driver) as fleet:
        with pytest.raises(RequestError, match="^max_staleness: .*up to 8 tokens.*allows 2"):
            fleet.generate([[5, 6]], max_staleness=2)
        assert fleet.generate([[5, 6]], max_staleness=8)[0].ok


@pytest.fixture(scope="module")
def served(make_settings, tmp_path_factory):
    settings = make_settings(fleet__name="fake-policy", fleet__num_shards=2, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, generation__max_new_tokens=4,
                             generation__vllm_cfg__skip_tokenizer_init=True,
                             refit__staging_dir=str(tmp_path_factory.mktemp("staging")))
    with served_fake_fleet(settings) as (fleet, handle):
        yield fleet, handle, settings


def _post(served, path, body):
    fleet, handle, settings = served
    return httpx.post(f"{handle.url}/v1/{path}", json={"model": settings.model_name(), **body}, timeout=60)


@pytest.mark.parametrize("path, body", [("completions", {"prompt": [5, 6, 7]}),
                                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_http_fields_are_refused_by_name_or_honoured_with_the_digest(served, path, body):
    fleet = served[0]
    version = fleet.weight_version
    too_new = _post(served, path, {**body, "min_version": version + 1})
    assert too_new.status_code == 400 and too_new.json()["error"]["param"] == "min_version", too_new.text
    assert f"weight version {version}" in too_new.json()["error"]["message"]
    bad = _post(served, path, {**body, "max_staleness": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_staleness", bad.text
    report = _refit(fleet)
    ok = _post(served, path, {**body, "min_version": report.version, "max_staleness": 0})
    assert ok.status_code == 200, ok.text
    prov = ok.json()["nemo_gen"]
    assert prov["weight_version"] == report.version and prov["weight_digests"] == [report.digest]
    assert ok.json()["choices"][0]["nemo_gen"]["weight_digests"] == [report.digest]
