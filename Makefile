# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test demo venv ext clean bench lint

venv: $(STAMP)

# Re-install only when the pinned requirements or the build description change.
$(STAMP): requirements/requirements.txt requirements/constraints.txt setup.py pyproject.toml $(wildcard csrc/*)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/requirements.txt -c requirements/constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	@touch $(STAMP)

# Two processes: the tests marked one_env with Megatron's import refused (the check that they
# cannot depend on the megatron-core version; exit 5, none selected, is fine here), then the rest.
test: $(STAMP)
	$(PY) -m pytest tests --no-megatron $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest tests -m "not one_env" $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/megatron-video demo --cpu

# ruff lint + format check (pyproject.toml [tool.ruff]); CI runs it before the suites.
lint: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/lint.txt
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Attention benchmarks of docs/benchmarks.md (tens of minutes on 2 cores); yunchang: peer_usp only.
bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/bench.txt -c requirements/constraints.txt
	$(PY) benchmarks/attention_memory.py
	$(PY) benchmarks/attention_comm.py
	$(PY) benchmarks/peer_usp.py

clean:
	rm -rf build *.egg-info megatron_video/*.so
