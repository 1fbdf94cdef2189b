"""Shared fixtures. Expensive things are made once per session: the tiny model, one local Ray
cluster (8 logical CPUs and 4 logical GPUs, so GPU placement can be tested on this CPU
machine), and the Prefect test harness."""

from __future__ import annotations

import contextlib
import os

import pytest

# Nothing may come from a model hub; Ray must not phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TEST_NAMESPACE = "nemo_gen_tests"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray cluster for the session. Fleets launched in tests attach to it
    (and so leave it running); it is stopped here, by this process, never with `ray stop`."""
    import ray

    from nemo_gen.environment import configure_environment
    from nemo_gen.settings import NemoGenSettings

    configure_environment(NemoGenSettings.load())  # the reaping flag, before the raylet starts
    ray.init(
        address="local", num_cpus=8, num_gpus=4, include_dashboard=False,
        namespace=TEST_NAMESPACE, log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def make_settings(tiny_model_dir, tmp_path_factory):
    """Settings for the tiny model on CPU; keyword overrides use dotted keys."""
    from nemo_gen.settings import NemoGenSettings

    home = tmp_path_factory.mktemp("home")

    def make(**overrides):
        base = {
            "home": str(home),
            "model.path": str(tiny_model_dir),
            "fleet.device": "cpu",
            "ray.namespace": TEST_NAMESPACE,
            "generation.max_new_tokens": 16,
            "generation.vllm_cfg.max_model_len": 256,
        }
        base.update({k.replace("__", "."): v for k, v in overrides.items()})
        return NemoGenSettings.load(overrides=base)

    return make


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # Heartbeats add ~1 s to every flow run in tests; the env var cannot express None.
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), _harness_server_fixed():
        with prefect_test_harness(server_startup_timeout=120):
            yield


@contextlib.contextmanager
def _harness_server_fixed():
    """Prefect's test harness serves ``prefect.server.api.server:create_app`` in a subprocess; it
    gets ``nemo_gen.prefect_server.create_app`` (the same app, with the fix for Prefect 3.7's SQLite
    automations deadlock that nemo-gen's own server runs), or its server can hang for good when
    ``nemo-gen deploy`` re-creates the crash automation (a clean clone's CI, 2026-12-02)."""
    import subprocess
    from unittest import mock

    from prefect.server.api.server import SubprocessASGIServer

    from nemo_gen.prefect_server import APP_FACTORY, PREFECT_APP_FACTORY

    real_popen, launch = subprocess.Popen, SubprocessASGIServer._run_uvicorn_command

    def popen(args, **kwargs):
        assert PREFECT_APP_FACTORY in args, args  # Prefect changed how its harness starts the server
        return real_popen([APP_FACTORY if a == PREFECT_APP_FACTORY else a for a in args], **kwargs)

    def fixed_launch(self):
        with mock.patch("prefect.server.api.server.subprocess.Popen", popen):
            return launch(self)

    with mock.patch.object(SubprocessASGIServer, "_run_uvicorn_command", fixed_launch):
        yield


# Under pytest-xdist (make test's --dist loadfile --no-loadscope-reorder) files are handed out in
# collection order, one whole file to whichever worker is free. The slow tiers go first so that
# the last files handed out are the seconds-long fast-tier ones and neither worker is left finishing
# a two-minute end-to-end file alone. (xdist's own reorder, by number of tests per file, sends
# the single-test end-to-end files last: the worst order here.) One process keeps the order the
# folders are named in: fast tiers first, so a broken core test shows in seconds.
_TIERS = ("tests/e2e/", "tests/engine/", "tests/flows/", "tests/gpu/", "tests/fake/", "tests/tooling/", "tests/core/")


def _tier(item) -> int:
    path = item.nodeid.replace("\\", "/")
    return next((i for i, tier in enumerate(_TIERS) if path.startswith(tier)), len(_TIERS))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_tier)  # stable: file order within a tier, test order within a file
