"""nemo_gen.core stays pure: importing it pulls in no ray, vllm, prefect, torch or transformers.

Two checks. At runtime, a fresh interpreter imports every module under ``nemo_gen/core``
(found by pkgutil, so modules added later are covered) and lists heavy modules that got
loaded. Statically, every import statement in the core's source — including imports inside
functions, which the runtime check cannot see — must be stdlib, ``nemo_gen.errors`` or core.

The subprocess stands in for the top-level ``nemo_gen`` package instead of executing its
``__init__``, so only what ``nemo_gen.core`` itself pulls in is measured.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("ray", "vllm", "prefect", "torch", "transformers", "prefect_ray")
REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "nemo_gen" / "core"

_CHECKER = """
import importlib, importlib.util, json, pkgutil, sys, types
root, package, heavy = sys.argv[1], sys.argv[2], set(sys.argv[3].split(","))
sys.path.insert(0, root)
top = package.split(".")[0]
spec = importlib.util.find_spec(top)
stub = types.ModuleType(top)
stub.__path__ = list(spec.submodule_search_locations)
sys.modules[top] = stub
imported = [package]
importlib.import_module(package)
for info in pkgutil.walk_packages(sys.modules[package].__path__, package + "."):
    importlib.import_module(info.name)
    imported.append(info.name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
print(json.dumps({"imported": imported, "heavy": loaded}))
"""


def heavy_modules_after_import(root: Path, package: str) -> dict[str, list[str]]:
    """Import ``package`` and all its submodules in a clean interpreter; report what loaded."""
    result = subprocess.run(
        [sys.executable, "-I", "-c", _CHECKER, str(root), package, ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_core_module_loads_nothing_heavy() -> None:
    report = heavy_modules_after_import(REPO, "nemo_gen.core")
    expected = {f"nemo_gen.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__"}
    assert expected <= set(report["imported"])  # the walk really covered the package
    assert report["heavy"] == []


def test_checker_catches_a_heavy_import_and_ignores_the_parent_init(tmp_path: Path) -> None:
    # A fake "ray" module, a core module that imports it, and a parent __init__ that imports
    # a fake "torch" — only the former is the core's doing.
    (tmp_path / "ray.py").write_text("")
    (tmp_path / "torch.py").write_text("")
    pkg = tmp_path / "fakepkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import torch\n")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "leaky.py").write_text("import ray\n")
    report = heavy_modules_after_import(tmp_path, "fakepkg.core")
    assert report["imported"] == ["fakepkg.core", "fakepkg.core.leaky"]
    assert report["heavy"] == ["ray"]


def _imported_names(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # Relative imports stay inside the core package by construction.
            if node.level == 0 and node.module:
                names.add(node.module)
    return names


def test_core_source_imports_only_stdlib_errors_and_core() -> None:
    offenders: dict[str, list[str]] = {}
    files = sorted(CORE.rglob("*.py"))
    assert files, "nemo_gen/core has no modules"
    for path in files:
        bad = sorted(
            name
            for name in _imported_names(path.read_text())
            if name.split(".")[0] not in sys.stdlib_module_names
            and name != "nemo_gen.errors"
            and not (name == "nemo_gen.core" or name.startswith("nemo_gen.core."))
        )
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert offenders == {}
