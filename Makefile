# One entry point for people and CI. `make parity` and `make test` set up .venv on first use.
PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup parity test lint goldens benchmark clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

## The main job: a CPU-mesh parity run of the built-in families, printing the agreement matrix.
parity: $(STAMP)
	$(BIN)/python -m conformance $(ARGS)

## The harness's own tests plus the conformance suite. pytest's exit code 5 (nothing collected)
## is a failure here, never a silent pass.
test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider $(ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Regenerate goldens for the selected tests only (ARGS narrows, e.g. ARGS='--family gpt3').
goldens: $(STAMP)
	$(BIN)/python -m pytest conformance/suite --snapshot-update $(ARGS)

benchmark: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV)
