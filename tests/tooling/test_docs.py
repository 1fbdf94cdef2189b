"""The prose is checked against the tree: every repository path docs/architecture.md and the
README's layout map name exists, the shard wire and the data paths name functions their files
define, the README stays a front page (at most 200 lines), and every relative link in the
README and docs/ resolves to a file."""

from __future__ import annotations

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README_MAX_LINES = 200

TOP = ("nemo_gen", "flows", "tasks", "tests", "bench", "examples", "deployments", "docs")
# A repository path: a top-level folder, then path characters, ending on a name or a slash.
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/(?:[\w.-]+/)*[\w.-]*)")
# [text](target) and ![alt](target); the target ends at a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")



def repo_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text)}


def layout_map() -> str:
    """The fenced block under the README's ``## Layout`` heading."""
    section = README.read_text().split("## Layout", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL)
    assert block, "README.md: the Layout section has no fenced map"
    return block.group(1)


def layout_paths(block: str) -> set[str]:
    """Full paths in the map, and bare ``name.py`` files resolved against the folder of their entry
    (``nemo_gen/fleet/   ... fleet.py ...`` names nemo_gen/fleet/fleet.py)."""
    paths, folder = set(), ""
    for line in block.splitlines():
        head = line[:25].strip()
        if head:
            first = head.split()[0]
            folder = first if first.endswith("/") else ""
        paths |= repo_paths(line)
        if folder:
            rest = PATH.sub(" ", line)
            paths |= {folder + name for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", rest)}
    return paths


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def links(doc: Path) -> dict[str, str]:
    """Each relative link target of ``doc``, as a repository path -> the target as written."""
    found = {}
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # http(s), mailto; an anchor in the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        found[path.relative_to(ROOT).as_posix()] = target
    return found


def test_every_path_architecture_md_names_exists():
    named = repo_paths(ARCHITECTURE.read_text())
    assert len(named) > 30, f"docs/architecture.md names only {len(named)} repository paths"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_path_the_readme_layout_map_names_exists():
    named = layout_paths(layout_map())
    assert {"nemo_gen/core/", "nemo_gen/fleet/driver.py", "nemo_gen/shard/actor.py"} <= named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"README.md's layout map names paths that do not exist: {missing}"


def _defines(path: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", (ROOT / path).read_text(), re.M) is not None


def test_the_shard_wire_table_lists_methods_the_shard_actor_defines():
    wire = ARCHITECTURE.read_text().split("## The shard wire", 1)[1].split("\n## ", 1)[0]
    methods = {name for cell in re.findall(r"^\| (.+?) \|", wire, re.M)
               for name in re.findall(r"`(\w+)\(", cell)}
    assert len(methods) >= 15, f"the wire table lists only {sorted(methods)}"
    shell = ("nemo_gen/shard/actor.py", "nemo_gen/shard/host.py", "nemo_gen/shard/rules.py", "nemo_gen/shard/sleep_rules.py")
    missing = sorted(m for m in methods if not any(_defines(path, m) for path in shell))
    assert missing == [], f"docs/architecture.md's wire lists methods the shard does not define: {missing}"
    from nemo_gen.shard.host import SHARD_CALLS

    unlisted = sorted(SHARD_CALLS - methods)
    assert unlisted == [], f"shard calls (nemo_gen/shard/host.py SHARD_CALLS) missing from the wire table: {unlisted}"


def path_steps() -> list[tuple[str, str]]:
    """(file, name) for each step of the four data paths written as ``file`` — ``Name...``."""
    paths = ARCHITECTURE.read_text().split("## Four data paths", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^\d+\. `([\w/.]+)` — `([\w.]+)", paths, re.M)
    return [(path, name.split(".")[-1]) for path, name in steps]


def test_each_data_path_step_names_a_function_its_file_defines():
    steps = path_steps()
    assert len(steps) >= 25, f"only {len(steps)} data-path steps name a function"
    wrong = [f"{path}: {name}" for path, name in steps if not (ROOT / path).is_file() or not _defines(path, name)]
    assert wrong == [], f"docs/architecture.md's data paths name what their files do not define: {wrong}"


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:10])
    assert "make run" in head and "make test" in head, "README.md must open with the two commands"


def test_every_relative_link_resolves():
    missing = {f"{doc.relative_to(ROOT)}: {target}"
               for doc in doc_files() for path, target in links(doc).items()
               if not (ROOT / path).exists()}
    assert sorted(missing) == [], f"links to files that do not exist: {sorted(missing)}"
