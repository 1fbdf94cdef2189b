"""The staging file on a real CPU fleet: a SIGKILLed driver's file is gone once the fleet
starts, and a staging directory too small for the model refuses the refit (``RefitError``
naming the bytes needed and free) while the fleet serves its old version, token for token."""

from __future__ import annotations

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.manifest import RefitError
from nemo_gen.tiny_model import make_tiny_model
from tests.tooling.test_staging import _child_staging, _fake_free, _sigkill, small_tmpfs

pytestmark = pytest.mark.engine

NAME = "staging"
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    """The fleet's refit.staging_dir: a 1 MiB tmpfs (a container's small /dev/shm; the tiny
    model needs ~1.8 MB) where one can be mounted, else a plain directory."""
    path = tmp_path_factory.mktemp("staging") / "shm"
    try:
        with small_tmpfs(path, "1m"):
            yield path, True
            return
    except pytest.skip.Exception:
        path.mkdir(parents=True, exist_ok=True)
        yield path, False


@pytest.fixture(scope="module")
def started(ray_cluster, make_settings, shm):
    """A dead driver's staging file, then a fleet launched on that staging directory."""
    directory, _ = shm
    driver, dead_file = _child_staging(directory, NAME)
    _sigkill(driver)
    assert dead_file.exists()
    fleet = GenerationFleet.launch(make_settings(fleet__name=NAME, fleet__num_shards=1,
                                                 refit__staging_dir=str(directory), health__auto_recover=False))
    yield fleet, dead_file
    fleet.shutdown()


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models-b") / "tiny-b", seed=1)


def greedy(fleet):
    results = fleet.generate(PROMPTS, temperature=0)
    return [r.token_ids for r in results], {r.weight_version for r in results}


def test_fleet_start_reclaims_a_sigkilled_drivers_staging_file(started):
    _, dead_file = started
    assert not dead_file.exists(), "the fleet started and left a dead driver's staging file"


@pytest.mark.parametrize("room", ["tmpfs", "statvfs"])
def test_too_small_a_staging_dir_refuses_the_refit_and_the_fleet_serves_on(started, shm, model_b, room,
                                                                             monkeypatch):
    fleet, _ = started
    directory, mounted = shm
    if room == "tmpfs" and not mounted:
        pytest.skip("no tmpfs could be mounted here: the statvfs case covers the refusal")
    if room == "statvfs":  # only the free-space number is faked
        _fake_free(monkeypatch, directory, 64 * 1024)
    tokens, versions = greedy(fleet)
    assert versions == {0}

    with pytest.raises(RefitError) as err:
        fleet.refit(str(model_b))
    message = str(err.value)
    assert "no weight was changed" in message
    needed = int(message.split("needs ")[1].split(" bytes")[0])
    free = int(message.split("has ")[1].split(" bytes free")[0])
    assert needed > 1_000_000 and free < needed
    if room == "statvfs":
        assert free == 64 * 1024

    assert fleet.weight_version == 0
    assert {s.state for s in fleet.status()} == {"healthy"}
    assert greedy(fleet) == (tokens, {0})
