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

## Each suite module, then the harness's own tests, each in its own process: in one long
## process, jaxlib 0.12.0.1 segfaults reading an executable from the persistent
## compilation cache after a few hundred compilations. pytest's exit code 5 (nothing
## collected) is a failure when no suite module collected anything, or for tests/.
SUITE_MODULES := $(sort $(wildcard conformance/suite/test_*.py))

test: $(STAMP)
	@status=0; ran=0; for target in $(SUITE_MODULES) tests; do \
	  $(BIN)/python -m pytest -p no:cacheprovider $$target $(ARGS); code=$$?; \
	  if [ $$code -eq 5 ] && [ $$target != tests ]; then continue; fi; \
	  if [ $$code -eq 5 ]; then echo "error: pytest collected no tests in $$target" >&2; code=1; fi; \
	  if [ $$target != tests ]; then ran=1; fi; \
	  if [ $$code -ne 0 ]; then status=$$code; fi; \
	done; \
	if [ $$ran -eq 0 ]; then echo "error: pytest collected no suite tests" >&2; status=1; fi; \
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
