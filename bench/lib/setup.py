"""The set-up the CPU benchmarks share: the environment they run in (offline, quiet), the
repository root and default working directory, the machine's load, argument checks, and
``LocalCpu``: a work directory with the tiny model and a private local Ray cluster. Heavy imports
(Ray, vLLM, nemo_gen's fleet) happen inside the functions that need them, so that
``python -m bench NAME --help`` stays fast."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / ".nemo-gen" / "bench"  # the default working directory of the fleet benchmarks


def quiet_environment(vllm_log: str = "WARNING") -> None:
    """Before anything imports vLLM, Ray, transformers or Prefect: no network, no usage stats, and
    engine logs at ``vllm_log`` (the GPU benchmark keeps INFO: it reads the launch breakdown)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", vllm_log)
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def fake_overrides(home: Path, model_dir: str) -> dict[str, Any]:
    """Settings for a fleet of fake shards (``--fake``): the tiny model (made under ``home`` /
    ``model_dir``) for its tokenizer and chat template; the router decodes the fake shards' tokens."""
    from nemo_gen.tiny_model import make_tiny_model

    return {"model.path": str(make_tiny_model(home / model_dir)), "generation.vllm_cfg.skip_tokenizer_init": True,
            "health.auto_recover": False}


@contextlib.contextmanager
def fleet_of(settings: Any, fake: bool):
    """A run's fleet: engines (``GenerationFleet.launch``), or with ``fake`` shards of tests/fakes.py
    (no Ray, no engines, tokens made at once: what is left is the driver's and server's CPU)."""
    if not fake:
        from nemo_gen.fleet.fleet import GenerationFleet

        with GenerationFleet.launch(settings) as fleet:
            yield fleet
        return
    from tests.fakes import FakeDriver, fake_fleet

    driver = FakeDriver()
    fleet = fake_fleet(settings, driver)
    try:
        yield fleet
    finally:
        fleet.shutdown()
        driver.close()


def at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> argparse.Namespace:
    """``args``, once every option in ``names`` is >= 1 (else argparse's error naming it)."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def make_prompts(n: int) -> list[str]:
    """``n`` distinct prompts over the built-in topics of ``nemo-gen run`` (defined in settings)."""
    from nemo_gen.settings import RunSettings

    topics = tuple(RunSettings().prompts)
    return [f"{topics[i % len(topics)]} (request {i})" for i in range(n)]


class LocalCpu:
    """A work directory, the tiny model made in it, a private local Ray cluster in a namespace of
    the benchmark's name, and settings for CPU fleets of that model. The caller stops Ray
    (``ray.shutdown()``) and its fleets."""

    def __init__(self, name: str):
        import ray

        from nemo_gen.environment import configure_environment
        from nemo_gen.settings import NemoGenSettings
        from nemo_gen.tiny_model import make_tiny_model

        self.name = name
        self.work = Path(tempfile.mkdtemp(prefix=f"nemo-gen-{name}-"))
        self.model = make_tiny_model(self.work / "tiny")
        configure_environment(NemoGenSettings.load())  # the reaping flag, before the raylet starts
        ray.init(address="local", num_cpus=8, include_dashboard=False, namespace=name, log_to_driver=False)

    def settings(self, **overrides: Any):
        """A CPU fleet of the tiny model on this cluster; ``overrides`` use dotted keys."""
        from nemo_gen.settings import NemoGenSettings

        return NemoGenSettings.load(overrides={
            "home": str(self.work / "home"), "model.path": str(self.model), "fleet.device": "cpu",
            "ray.namespace": self.name, "fleet.name": self.name, "generation.vllm_cfg.max_model_len": 256,
            **overrides})


def one_shard_tiny(name: str):
    """Settings for a one-shard CPU fleet of the tiny model made in a fresh work directory (probes
    every 60 s, so that none lands in a measured batch), and that directory."""
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix=f"nemo-gen-bench-{name}-"))
    settings = NemoGenSettings.load(overrides={
        "home": str(work / "home"), "model.path": str(make_tiny_model(work / "tiny")), "fleet.name": f"bench-{name}",
        "fleet.num_shards": 1, "generation.vllm_cfg.max_model_len": 512, "health.probe_interval_s": 60})
    return settings, work


def token_prompts(n: int, length: int = 32) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` token ids (BOS first), inside the tiny model's vocabulary."""
    return [[1] + [(7 * i + j) % 250 + 4 for j in range(length - 1)] for i in range(n)]


def two_tiny_models(prefix: str) -> tuple[Path, Path, Path]:
    """(a work directory, the tiny model, one of the same shape with other weights): the two
    checkpoints a refit benchmark alternates between."""
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix=prefix))
    return work, make_tiny_model(work / "a"), make_tiny_model(work / "b", seed=1)
