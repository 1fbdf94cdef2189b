"""The ``ray``, ``prefect`` and ``run`` sections and their defaults: the Ray cluster, the
Prefect API, and the inputs/outputs of ``nemo-gen run``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from nemo_gen.settings.base import Section


class RaySettings(Section):
    address: str | None = Field(
        None,
        description="Ray cluster to attach to ('auto', 'host:port'); unset: a private local cluster "
        "started by nemo_gen and stopped with the fleet.",
    )
    namespace: str = Field("nemo_gen", description="Ray namespace of the fleet's actors.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster; unset: all cores.")
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of the local cluster; unset: detected. Logical GPUs can be "
        "declared for placement tests."
    )
    log_to_driver: bool = Field(True, description="Echo engine and worker output in the driver's terminal.")
    include_dashboard: bool = Field(False, description="Start Ray's dashboard (local cluster only).")
    dashboard_host: str = Field("127.0.0.1", description="Dashboard bind address.")
    object_store_memory_gb: float | None = Field(None, gt=0, description="Object store size (local).")


class PrefectSettings(Section):
    api_url: str | None = Field(
        None,
        description="Prefect API to report to; unset: PREFECT_API_URL, else a local server that "
        "nemo-gen starts on 127.0.0.1 and stops afterwards.",
    )
    host: str = Field("127.0.0.1", description="Bind address of the managed local server.")
    port: int | None = Field(None, ge=1, le=65535, description="Port of the managed server; unset: a free one.")
    server_start_timeout_s: float = Field(120.0, gt=0, description="Deadline for the managed server.")
    work_pool: str = Field("nemo-gen", description="Process work pool the deployments run on.")
    crash_reruns: int = Field(
        2, ge=0, description="How many times `nemo-gen deploy`'s automation re-runs a Crashed flow run "
        "(a killed flow-run process) of a nemo-gen deployment.",
    )
    allowed_paths: list[Path] = Field(
        default_factory=list,
        description="Directories deployment parameters (checkpoints, prompt and output files) may "
        "point into; empty: the current directory and `home`.",
    )


class RunSettings(Section):
    prompts: list[str] = Field(
        default_factory=lambda: [
            "The quick brown fox",
            "Once upon a time",
            "In a distant galaxy",
            "The meaning of life is",
            "Reinforcement learning is",
            "A fleet of engines",
            "The weather today",
            "Hello, my name is",
        ],
        description="Built-in prompts for `nemo-gen run` when no input file is given.",
    )
    input: Path | None = Field(
        None, description="JSONL of prompts: {'prompt': str} or {'prompt_token_ids': [int]} per line."
    )
    batch_size: int = Field(
        64, ge=1, description="Prompts in flight at once. AsyncLLM shards (vllm_cfg.async_engine): one "
        "request per line, a new one sent as each finishes; the sync engine: prompts per fleet.generate call."
    )
    output: Path | None = Field(
        None, description="JSONL results, one line per input line in input order once complete; while "
        "the run goes, each line is appended as it finishes (the sync engine: each batch's), so a killed run "
        "keeps them (run.resume). Unset: `home`/outputs/<flow>-<timestamp>.jsonl.",
    )
    resume: bool = Field(
        False, description="Keep the lines already in `output` that generated without error and "
        "generate only the others (a killed or interrupted run continues where it stopped). Refused when "
        "`output`'s fingerprint (<output>.fingerprint.json: model, sampling settings, weight version, "
        "input) differs from this run's, naming the field.",
    )
    overwrite: bool = Field(
        False, description="Replace an `output` that already holds rows. Unset (and no run.resume): such "
        "an output is refused before anything starts, so an earlier run's rows are never lost by mistake.",
    )

