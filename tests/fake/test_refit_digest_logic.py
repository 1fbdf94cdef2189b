"""The digest rule of a refit on the fake tier (tests/fakes.py: our own refit logic, the real
staging file and digest kernel; fake engines): every shard checks the trainer's per-tensor
digests before loading; a shard whose bytes differ is quarantined through the slot table, naming
the first differing tensor, while the others move on; when no shard reads the trainer's bytes the
refit is refused and the fleet serves on; results carry the digest beside each version span.
Real engines: tests/engine/test_refit_digest.py."""

from __future__ import annotations

import pytest
import torch

from nemo_gen.core.digest import combine
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.manifest import RefitError
from nemo_gen.vllm_ext.digest import tensor_digest
from tests.fakes import fake_fleet

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def _tensors(scale=1.0):
    return {"w": torch.ones(4, 4) * scale, "b": torch.zeros(4)}


def _trainer_digest(tensors, dtype):
    """The trainer's digest computed independently of the refit: each tensor as staged."""
    return combine((n, tensor_digest(t.to(dtype))) for n, t in tensors.items())


def test_results_carry_the_digest_of_the_weights_beside_each_span(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        before = fleet.generate(PROMPTS)
        assert all(r.weight_digests == [None] for r in before)  # launch weights: not digested here
        tensors = _tensors()
        report = fleet.refit(tensors)
        dtype = getattr(torch, fleet.refitter.engine_dtype)
        assert report.digest == _trainer_digest(tensors, dtype) and report.digest_seconds > 0
        assert report.to_json()["digest"] == report.digest
        for r in fleet.generate(PROMPTS):
            assert r.weight_versions == [(1, len(r.token_ids))] and r.weight_digests == [report.digest]
            assert r.samples[0].weight_digests == [report.digest]
        second = fleet.refit(_tensors(2.0))
        assert second.digest != report.digest  # other weights, another digest
        assert {tuple(r.weight_digests) for r in fleet.generate(PROMPTS)} == {(second.digest,)}


def test_a_shard_reading_other_bytes_is_quarantined_naming_the_tensor(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path), health__auto_recover=False), driver) as fleet:
        driver.shard(fleet.handle(1)).corrupt_staged = "b"
        report = fleet.refit(_tensors())
        (bad,) = report.failed
        assert bad.shard == 1 and "weight digest mismatch at tensor 'b'" in bad.error and "nothing loaded" in bad.error
        assert "nemo_gen_load_staged" not in driver.shard(fleet.handle(1)).rpcs  # it loaded nothing
        assert driver.shard(fleet.handle(1)).weight_version == 0  # its engine still holds version 0
        assert fleet.health.state_of(1) is ShardState.DEAD and fleet.health.serving_shards() == [0]
        assert "'b'" in fleet.health.snapshot()[1].last_error
        assert fleet.weight_version == 1 and driver.shard(fleet.handle(0)).weight_version == 1
        results = fleet.generate(PROMPTS)
        assert {r.shard for r in results} == {0} and {tuple(r.weight_digests) for r in results} == {(report.digest,)}


def test_when_no_shard_reads_the_trainers_bytes_the_refit_is_refused_and_the_fleet_serves_on(
        settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        for handle in fleet.shards:
            driver.shard(handle).corrupt_staged = "w"
        with pytest.raises(RefitError, match="no weight was changed: .*weight digest mismatch at tensor 'w'"):
            fleet.refit(_tensors())
        assert fleet.weight_version == 0 and fleet.health.serving_shards() == [0, 1]
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {0}


def test_refit_digest_off_checks_nothing_and_claims_nothing(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path), refit__digest=False), driver) as fleet:
        driver.shard(fleet.handle(1)).corrupt_staged = "b"  # not checked: the setting is off
        report = fleet.refit(_tensors())
        assert report.ok and report.digest is None and report.digest_seconds == 0.0
        assert {tuple(r.weight_digests) for r in fleet.generate(PROMPTS)} == {(None,)}
