"""The ``nemo-gen`` command: run the pipeline, generate over a JSONL file, a fleet that outlives
one command (``fleet up|status|down``, ``refit``), register the Prefect deployments (``deploy``),
make the tiny model, show and describe settings.

Exit codes: 0 all requests generated; 3 the job ran but some lines or requests failed (they
are in the output with their reasons); 2 bad settings or input (nothing was started);
1 anything else; 130 / 143 interrupted by SIGINT / SIGTERM (one line says so, and what the
command started has been stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from nemo_gen.cli_parser import build_parser
from nemo_gen.core.modes import RefitMode
from nemo_gen.errors import DataError, NemoGenError
from nemo_gen.interrupt import SignalGuard

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_PARTIAL = 0, 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    guard = SignalGuard()
    if args.command in ("run", "generate", "fleet", "refit", "serve"):
        guard.install()  # these start Ray, engines, a Prefect server: an interrupt stops them
    try:
        if args.command == "make-tiny-model":
            return _make_tiny_model(args)
        if args.command == "config":
            return _show_config(args)
        if args.command == "fleet":
            return _fleet(args, guard)
        if args.command == "refit":
            return _refit(args, guard)
        if args.command == "deploy":
            return _deploy(args)
        if args.command == "serve":
            return _serve(args, guard)
        return _run(args, name=args.command, guard=guard)
    except (DataError, FileExistsError) as exc:  # FileExistsError: make-tiny-model onto another dir
        if guard.received is not None:
            return guard.report()
        print(f"nemo-gen: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NemoGenError as exc:
        if guard.received is not None:
            return guard.report()
        print(f"nemo-gen: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        if guard.received is None:  # Ctrl-C before the guard was installed
            guard.received = getattr(exc, "signum", 2)
        return guard.report()
    except BaseException:
        # Anything that goes wrong while an interrupted command stops what it started is part
        # of the interruption, not a second report.
        if guard.received is not None:
            return guard.report()
        raise
    finally:
        guard.uninstall()


def _make_tiny_model(args: argparse.Namespace) -> int:
    from nemo_gen.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, overwrite=args.overwrite)
    print(f"tiny model ready: {path}")
    return EXIT_OK


def _show_config(args: argparse.Namespace) -> int:
    from nemo_gen.cli_view import describe_text, not_used_comment

    if args.describe is not None:
        from nemo_gen.settings import describe_settings

        print(describe_text(describe_settings(args.describe)), end="")
        return EXIT_OK
    import yaml

    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(args.config, args.overrides)
    print(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), end="")
    print(not_used_comment([n.to_json() for n in settings.not_used]), end="")
    return EXIT_OK


def _persistent_settings(args: argparse.Namespace):
    from flows.params import require_ray_address
    from nemo_gen.settings import NemoGenSettings

    # Worker output would land in our stdout (breaking --json); it stays in Ray's log files.
    quiet = [] if getattr(args, "verbose", False) else ["ray.log_to_driver=false"]
    args.overrides = quiet + list(args.overrides)
    settings = NemoGenSettings.load(args.config, args.overrides)
    require_ray_address(settings)
    return settings


def _deploy(args: argparse.Namespace) -> int:
    """Register the deployments with an existing Prefect server (never a managed one: it would
    stop, and its deployments with it, when this command ends)."""
    from nemo_gen.errors import ConfigError
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(args.config, args.overrides)
    if not (settings.prefect.api_url or os.environ.get("PREFECT_API_URL")):
        raise ConfigError("nemo-gen deploy registers with a running Prefect server: start one "
                          "(`python -m nemo_gen.prefect_server server start`: `prefect server start` with "
                          "Prefect 3.7's SQLite automations fix) and set PREFECT_API_URL", field="prefect.api_url")
    _quiet()
    from nemo_gen.prefect_api import prefect_api

    with prefect_api(settings):
        from flows.deploy import AUTOMATION, deploy

        deployed = deploy(settings)
    results = deployed.deployments
    rows = [{"deployment": r.deployment, "id": str(r.id) if r.id else None, "error": r.error} for r in results]
    if args.json:
        print(json.dumps({"work_pool": settings.prefect.work_pool, "work_pool_template": deployed.pool.value,
                          "automation": AUTOMATION, "deployments": rows}, indent=2))
    else:
        from nemo_gen.cli_view import deploy_table

        deploy_table(settings.prefect.work_pool, deployed.pool.value, AUTOMATION, rows)
    return EXIT_PARTIAL if any(r.error for r in results) else EXIT_OK


def _fleet(args: argparse.Namespace, guard: SignalGuard) -> int:
    settings = _persistent_settings(args)  # refused (exit 2) before Ray is even imported
    guard.before_ray()
    from nemo_gen.fleet.fleet import GenerationFleet

    if args.fleet_command == "up":
        _quiet()
        from nemo_gen import progress
        from nemo_gen.cli_view import LiveView

        with LiveView(enabled=not args.json) as view, progress.listening(view.on_event):
            fleet = GenerationFleet.launch(
                settings, progress=progress.shard_event
            )
        rows = [s.to_json() for s in fleet.status()]
        fleet.detach()
    elif args.fleet_command == "status":
        # Not watching (as the flows attach): a status that found a dead shard would otherwise
        # start its replacement and wait for it to load before exiting; healing is `heal`'s.
        fleet = GenerationFleet.attach(settings, watch=False)
        rows = [s.to_json() for s in fleet.status()]
        fleet.detach()
    else:
        # Not watching: a dead shard's replacement would be loaded only to be stopped (the
        # shutdown waits for a recovery in progress: a whole engine start).
        fleet = GenerationFleet.attach(settings, watch=False)
        rows = [s.to_json() for s in fleet.status()]
        killed = fleet.shutdown()
        rows = [{**r, "state": "stopped"} for r in rows]
        if killed:
            print(f"killed engine processes that outlived their shard: {killed}", file=sys.stderr)
    if args.json:
        print(json.dumps({"fleet": settings.fleet.name, "shards": rows}, indent=2))
    else:
        from nemo_gen.cli_view import status_table

        status_table(settings.fleet.name, rows)
    return EXIT_OK


def _refit(args: argparse.Namespace, guard: SignalGuard) -> int:
    from nemo_gen.fleet.weight_sources import CheckpointSource

    settings = _persistent_settings(args)
    checkpoint = str(args.checkpoint.resolve())
    CheckpointSource(checkpoint)  # no such directory, no safetensors: refused (exit 2) before Ray starts
    guard.before_ray()
    if not args.verbose:
        _quiet()
    if args.no_prefect:
        from nemo_gen.fleet.fleet import GenerationFleet

        fleet = GenerationFleet.attach(settings)
        try:
            report = fleet.refit(checkpoint, version=args.version, in_flight=args.in_flight).to_json()
        finally:
            fleet.detach()
    else:
        from nemo_gen.prefect_api import prefect_api

        with prefect_api(settings):
            from flows.refit import refit

            report = refit(checkpoint=checkpoint, version=args.version, in_flight=args.in_flight,
                           config=str(args.config) if args.config else None, overrides=list(args.overrides))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"refit to weight version {report['version']}: {report['bytes'] / 1e6:.1f} MB in "
              f"{report['seconds']:.2f} s ({report['gb_per_s']:.2f} GB/s)")
        for s in report["shards"]:
            print(f"  shard {s['shard']}: " + ("ok" if s["ok"] else f"QUARANTINED: {s['error']}"))
    return EXIT_OK if report["ok"] else EXIT_PARTIAL


def _run(args: argparse.Namespace, name: str, guard: SignalGuard) -> int:
    from nemo_gen.settings import NemoGenSettings

    # Engine logs stay in Ray's log files unless asked for; a user's --set still wins.
    overrides = ([] if args.verbose else ["ray.log_to_driver=false"]) + list(args.overrides)
    if args.input is not None:
        overrides.append(f"run.input={json.dumps(str(args.input))}")
    if args.output is not None:
        overrides.append(f"run.output={json.dumps(str(args.output))}")
    if args.resume:
        overrides.append("run.resume=true")
    if args.overwrite:
        overrides.append("run.overwrite=true")
    # Validate settings, read the input and check the output before anything is started.
    settings = NemoGenSettings.load(args.config, overrides)
    if unset := _unset_defaults(settings, _RUN_DEFAULTS):
        overrides = unset + overrides
        settings = NemoGenSettings.load(args.config, overrides)
    from nemo_gen import pipeline

    lines = pipeline.load_prompts(settings)
    # Refused here (exit 2, nothing started): a bad output to resume or none named, a fingerprint
    # that differs, an existing output without --resume or --overwrite.
    kept = pipeline.resumable(settings, lines)
    if settings.run.output is None:
        # Named now, so every line is written there as it finishes (and an interrupt says where).
        overrides.append(f"run.output={json.dumps(str(pipeline.default_output(settings, name)))}")
        settings = NemoGenSettings.load(args.config, overrides)
    guard.on_report(lambda: _interrupted_note(settings, lines))
    guard.before_ray()
    if not args.verbose:
        _quiet()

    from nemo_gen import progress
    from nemo_gen.cli_view import LiveView

    view = LiveView(enabled=not args.json)
    started = time.monotonic()
    with view, progress.listening(view.on_event):
        if settings.not_used:
            view.note(f"{len(settings.not_used)} settings keys are not used by nemo_gen "
                      "(`nemo-gen config` lists them with the reason)")
        if args.resume:
            view.note(f"resuming: {len(kept)} of {len(lines)} lines already in {settings.run.output}")
        if args.no_prefect:
            summary = pipeline.run_pipeline(settings, name=name)
            ui = None
        else:
            from nemo_gen.prefect_api import prefect_api

            view.note("starting Prefect server" if not (settings.prefect.api_url or os.environ.get("PREFECT_API_URL")) else "using Prefect API")
            with prefect_api(settings) as api:
                view.note(f"Prefect API at {api.url}")
                from flows.pipeline import run_watched

                summary = run_watched(config=str(args.config) if args.config else None, overrides=overrides, name=name)
                ui = api
    summary["wall_seconds"] = time.monotonic() - started
    if ui is not None:
        summary["prefect_ui"] = ui.ui_url + (" (stopped; history kept in " + str(ui.home) + ")" if ui.managed else "")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        view.summary(summary, title=f"nemo-gen {name}")
    return EXIT_OK if summary["failed"] == 0 else EXIT_PARTIAL


# Defaults of a command, below the user's settings (a YAML, NEMO_GEN_* or --set that names the
# key wins). Each shard runs vLLM's AsyncLLM, which serves concurrent requests natively (the sync
# engine takes one call at a time and answers it when all of it is done) — unless refit.in_flight
# asks for keep/abort, which need the sync engine. `run`/`generate`: so that every line is its own
# request, written to the output the moment it finishes (pipeline.generate_lines). A server also
# keeps vLLM's stats, for /metrics.
_RUN_DEFAULTS = {"generation.vllm_cfg.async_engine": True}
_SERVE_DEFAULTS = {**_RUN_DEFAULTS, "generation.vllm_cfg.enable_vllm_metrics_logger": True}


def _unset_defaults(settings, defaults: dict[str, Any]) -> list[str]:
    """``defaults`` the settings do not name, as ``--set`` overrides to put before the user's."""
    return [f"{k}={json.dumps(v)}" for k, v in defaults.items() if not _explicit(settings, k)
            and not (k.endswith("async_engine") and settings.refit.in_flight is not RefitMode.DRAIN)]


def _serve(args: argparse.Namespace, guard: SignalGuard) -> int:
    """Fleet up (embedded defaults, as `nemo-gen run`) plus the HTTP server; runs until SIGINT /
    SIGTERM, then stops the server, the fleet, and the Ray cluster it started."""
    from nemo_gen.settings import NemoGenSettings

    overrides = ([] if args.verbose else ["ray.log_to_driver=false"]) + list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={json.dumps(args.host)}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    settings = NemoGenSettings.load(args.config, overrides)
    if unset := _unset_defaults(settings, _SERVE_DEFAULTS):
        settings = NemoGenSettings.load(args.config, unset + overrides)
    guard.before_ray()
    if not args.verbose:
        _quiet()
    from nemo_gen import progress
    from nemo_gen.cli_view import LiveView
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.server import serve, start_server

    with LiveView(enabled=not args.json) as view, progress.listening(view.on_event):
        fleet = serve(GenerationFleet.launch(settings, progress=progress.shard_event))
    with fleet:
        url = getattr(fleet, "http_url", None)  # its own server (vllm_cfg.expose_http_server)
        handle = None if url else start_server(fleet, settings)
        try:
            url = url or handle.url
            shards = [s.to_json() for s in fleet.status()]
            if args.json:
                print(json.dumps({"url": url, "openai_base_url": f"{url}/v1", "fleet": settings.fleet.name,
                                  "model": settings.model_name(), "weight_version": fleet.weight_version,
                                  "shards": shards}), flush=True)
            else:
                print(f"nemo-gen serve: fleet {settings.fleet.name!r} ({len(shards)} shards, model "
                      f"{settings.model_name()!r}, weight version {fleet.weight_version}) at {url} "
                      f"(OpenAI base URL {url}/v1); Ctrl-C stops it", flush=True)
            while handle is None or handle.running:
                time.sleep(0.5)
            print("nemo-gen serve: the HTTP server stopped", file=sys.stderr)
            return EXIT_FAILED
        finally:
            if handle is not None:
                handle.stop()


def _explicit(settings, dotted: str) -> bool:
    """Whether a source (YAML, environment, --set) set ``dotted``, as opposed to its default."""
    *sections, key = dotted.split(".")
    node = settings
    for name in sections:
        if name not in node.model_fields_set:
            return False
        node = getattr(node, name)
    return key in node.model_fields_set


def _interrupted_note(settings, lines) -> str:
    """What an interrupted run kept: the finished lines in its output, and how to continue."""
    from nemo_gen.jsonl import read_finished

    try:
        kept = len(read_finished(settings.run.output, lines))
    except DataError:
        return ""
    return f"{kept} of {len(lines)} lines are in {settings.run.output} (--resume continues)"


def _quiet() -> None:
    """Keep the terminal for the live view: engines, Ray and Prefect log warnings and up only.
    setdefault: an operator's explicit levels win."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
