"""`nemo-gen deploy` as an operator runs it, against a real Prefect API (the test harness's):
the deployments file holds one entrypoint that cannot be loaded — the command lists it with the
reason, registers every other deployment, prints the table and exits 3.

The command reads `deployments/prefect.yaml` of the repository it runs from, so it runs in a
copy of this one whose file has the extra, broken entry."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.flows

ROOT = Path(__file__).resolve().parents[2]


def _copy_repo(dst: Path) -> Path:
    for name in ("nemo_gen", "flows", "tasks", "deployments"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


async def _pools_of(ids: list[str]) -> dict[str, str]:
    """deployment id -> its work pool, as the API holds it."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return {i: (await client.read_deployment(uuid.UUID(i))).work_pool_name for i in ids}


def _rows(table: str) -> dict[str, tuple[str, str]]:
    """The table's rows: deployment -> (id, error). A cell too long for the terminal wraps onto
    lines whose deployment cell is empty (a long temporary path in an error does): joined back."""
    rows: dict[str, tuple[str, str]] = {}
    last = None
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("\u2502")]  # │
        if len(cells) != 5:  # "", deployment, id, error, ""
            continue
        if cells[1] or last is None:
            last = cells[1]
            rows[last] = (cells[2], cells[3])
        else:
            rid, err = rows[last]
            rows[last] = (rid + cells[2], err + cells[3])
    return rows


def test_deploy_registers_the_rest_and_exits_3_when_one_entrypoint_cannot_load(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    repo = _copy_repo(tmp_path / "repo")
    spec = repo / "deployments" / "prefect.yaml"
    data = yaml.safe_load(spec.read_text())
    good = [(e["entrypoint"], e["name"]) for e in data["deployments"]]
    data["deployments"].append({"name": "default", "entrypoint": "flows/missing.py:nothing"})
    spec.write_text(yaml.safe_dump(data, sort_keys=False))

    pool = f"deploy-cli-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(repo),
           "COLUMNS": "240", "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_gen.cli", "deploy", "--set", f"prefect.work_pool={pool}"],
        env=env, cwd=repo, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"deployments on work pool {pool!r}, its job template created" in proc.stdout
    rows = _rows(proc.stdout)
    assert rows.pop("flows/missing.py:nothing")[1].startswith("cannot load flows/missing.py:nothing: ")
    # every loadable entry was registered on the pool, and is listed with its id
    assert len(rows) == len(good), rows
    assert all(error == "" and len(dep_id) == 36 for dep_id, error in rows.values()), rows
    assert {name.split("/")[1] for name in rows} == {name for _, name in good}
    pools = asyncio.run(_pools_of([dep_id for dep_id, _ in rows.values()]))
    assert set(pools.values()) == {pool}
