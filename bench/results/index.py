"""Rewrites bench/results/README.md, the index: one section per dated folder, each note (``.md``)
with its title, then the raw files. Run after adding results: ``python bench/results/index.py``."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
HEAD = """# bench/results: the index

One folder per date; a benchmark run writes its result file there (`python -m bench NAME --json
bench/results/<date>/NAME.json`), and a note (`.md`) says what was run, on what, and what it shows.
Prefixes: `cpu-` the shared 2-core CPU machine, `h200-` the lent GPU host. Files before 2026-12-06
predate the result schema (bench/README.md): their top-level fields are the `metrics` of today's.
The current headline figures are in [docs/performance.md](../../docs/performance.md). This file is
written by `python bench/results/index.py`.
"""


def index() -> str:
    out = [HEAD]
    for folder in sorted(p for p in HERE.iterdir() if p.is_dir()):
        out.append(f"## [{folder.name}]({folder.name}/)\n")
        files = sorted(f for f in folder.iterdir() if f.is_file())
        for f in files:
            if f.suffix == ".md":
                title = f.read_text().splitlines()[0].lstrip("# ").strip()
                out.append(f"- [{f.name}]({folder.name}/{f.name}): {title}")
        raw = [f"[{f.name}]({folder.name}/{f.name})" for f in files if f.suffix != ".md"]
        if raw:
            out.append("- raw: " + ", ".join(raw))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    (HERE / "README.md").write_text(index())
