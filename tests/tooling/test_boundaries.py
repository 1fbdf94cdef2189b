"""Package boundaries that ran back up the layering (review 2026-12-07, problem 5), each held by a
test that reads every import, function-level and TYPE_CHECKING ones included:

- the server never imports the actor side (``nemo_gen.shard``): what both need lives in core;
- config never imports the fleet: the Ray driver is built from settings beside the driver;
- settings and config are one direction: settings use config's machinery (the recipe loader,
  vLLM's choices), config never imports settings (the builders from settings live in
  ``nemo_gen/settings/policies.py``);
- ``nemo_gen`` never imports the top-level ``flows`` or ``tasks`` packages: they use the library,
  never the other way.

Each check can fail: ``test_the_checks_see_a_function_level_import`` plants an offending import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.tooling.test_structure import PACKAGE, ROOT, graph, modules


def importers(of: str, among: str, edges: dict[str, set[str]] | None = None) -> list[str]:
    """``module imports target`` for each module under ``among`` that imports anything under ``of``."""
    edges = graph() if edges is None else edges
    return sorted(f"{m} imports {d}" for m, deps in edges.items() if m == among or m.startswith(among + ".")
                  for d in deps if d == of or d.startswith(of + "."))


def outside_imports(path: Path, packages: tuple[str, ...]) -> list[str]:
    """``file:line name`` for every import in ``path`` of a module under one of ``packages``."""
    found, where = [], path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"{where}:{node.lineno} {n}" for n in names if n.split(".")[0] in packages]
    return found


def test_the_server_never_imports_the_actor_side():
    assert importers("nemo_gen.shard", "nemo_gen.server") == []


def test_config_never_imports_the_fleet():
    assert importers("nemo_gen.fleet", "nemo_gen.config") == []


def test_settings_and_config_import_one_way():
    assert importers("nemo_gen.settings", "nemo_gen.config") == []


@pytest.mark.xfail(strict=True, reason="nemo_gen/cli.py still runs four Prefect flows by importing them "
                   "(flows.params, flows.deploy, flows.refit, flows.pipeline): open, issue 47 item 4")
def test_nemo_gen_never_imports_flows_or_tasks():
    found = [hit for path in modules().values() for hit in outside_imports(path, ("flows", "tasks"))]
    assert found == []


def test_the_checks_see_a_function_level_import(tmp_path):
    edges = {"nemo_gen.server.app": {"nemo_gen.core.wire"}, "nemo_gen.server.relay": {"nemo_gen.shard.batch"}}
    assert importers("nemo_gen.shard", "nemo_gen.server", edges) == ["nemo_gen.server.relay imports nemo_gen.shard.batch"]
    planted = tmp_path / "m.py"
    planted.write_text("def run():\n    from flows.pipeline import run_watched\n    import tasks.fleet\n")
    found = outside_imports(planted, ("flows", "tasks"))
    assert [hit.split(" ")[1] for hit in found] == ["flows.pipeline", "tasks.fleet"]
    assert PACKAGE.is_dir()


def test_the_fleet_starts_no_service_of_its_own_package():
    # The HTTP server is composed with the fleet where the process is (``nemo_gen.server.serve``),
    # never looked up by the fleet behind an entry point, which hid the edge from the import graph.
    hits = [f"{p.relative_to(ROOT)}" for p in (PACKAGE / "fleet").rglob("*.py")
            if "entry_points" in p.read_text() or "importlib.metadata" in p.read_text()]
    assert hits == []
    assert importers("nemo_gen.server", "nemo_gen.fleet") == []
