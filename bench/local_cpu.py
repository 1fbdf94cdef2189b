"""The set-up the one-shard CPU benchmarks share (``engine_start.py``, ``refit_call.py``): a work
directory, the tiny model made in it, a private local Ray cluster in a namespace of the
benchmark's name, and settings for CPU fleets of that model. The caller stops Ray
(``ray.shutdown()``) and its fleets."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


class LocalCpu:
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
