# Two entry points for a newcomer: `make compare` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,hf,bench]'
	$(BIN)/python -m backends.warm
	touch $@

.PHONY: install compare test lint slow bench wheel
install: $(BIN)/.installed

compare: install
	$(BIN)/python -m experiments.compare

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check planner backends runtime experiments tests
	$(BIN)/ruff format --check planner backends runtime experiments tests
	$(BIN)/mypy

slow: install
	$(BIN)/python -m pytest -q -m slow

bench: install
	$(BIN)/python -m pytest -q -m benchmark --benchmark-enable

wheel: install
	$(BIN)/pip wheel --no-deps --no-build-isolation -q -w dist .
