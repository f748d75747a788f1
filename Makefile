# The two commands of the README: `make serve` and `make test`. Both set everything up and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: setup model serve test lint bench bench-spec clean

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/eaglegate fetch-model

serve: model
	$(VENV)/bin/eaglegate serve $(ARGS)

test: model
	bash scripts/test-deps.sh
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check server worker speculative tests bench scripts

bench: model
	$(PY) bench/decode.py

# The speculative benchmark of issue 5, llama.cpp included: llama-cpp-python builds from source (~7 min, once).
bench-spec: model
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check \
		llama-cpp-python==0.3.36 diskcache==5.6.3
	$(PY) bench/spec.py $(ARGS)

clean:
	rm -rf $(VENV)
