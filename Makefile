# One entry point for people and CI. `make parity` and `make test` set up .venv on first use.
PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
## MaxText (optional extra) lives in its own venv, so `make test` never needs it.
MAXTEXT_VENV := .venv-maxtext
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed

.PHONY: setup setup-maxtext parity test test-maxtext lint goldens goldens-maxtext benchmark clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup-maxtext: $(MAXTEXT_STAMP)

$(MAXTEXT_STAMP): pyproject.toml constraints.txt constraints-maxtext.txt
	$(PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet -c constraints.txt \
	  -c constraints-maxtext.txt -e '.[dev,maxtext]'
	touch $(MAXTEXT_STAMP)

## The main job: a CPU-mesh parity run of the built-in families, printing the agreement matrix.
parity: $(STAMP)
	$(BIN)/python -m conformance $(ARGS)

## Each suite module, then the harness's own tests, each in its own process: in one long
## process, jaxlib 0.12.0.1 segfaults reading an executable from the persistent
## compilation cache after a few hundred compilations. pytest's exit code 5 (nothing
## collected) is a failure when no suite module collected anything, or for tests/.
SUITE_MODULES := $(sort $(wildcard conformance/suite/test_*.py))

## $(call run-modules,python,targets,pytest args)
define run-modules
	@status=0; ran=0; for target in $(2); do \
	  $(1) -m pytest -p no:cacheprovider $$target $(3); code=$$?; \
	  if [ $$code -eq 5 ] && [ $$target != tests ]; then continue; fi; \
	  if [ $$code -eq 5 ]; then echo "error: pytest collected no tests in $$target" >&2; code=1; fi; \
	  if [ $$target != tests ]; then ran=1; fi; \
	  if [ $$code -ne 0 ]; then status=$$code; fi; \
	done; \
	if [ $$ran -eq 0 ]; then echo "error: pytest collected no suite tests" >&2; status=1; fi; \
	exit $$status
endef

test: $(STAMP)
	$(call run-modules,$(BIN)/python,$(SUITE_MODULES) tests,$(ARGS))

## The MaxText families alone, in the maxtext venv (the default run skips them there).
## It first fails if they would skip: an unusable maxtext must not pass as all-skipped.
MAXTEXT_READY := import sys; from conformance.families import select; \
  sys.exit("\n".join(f"{f.name}: {r}" for f in select(["maxtext-*"]) if (r := f.unavailable())) or None)

## MAXTEXT_SCOPE is what CI affords beside `make test`: MaxText's default scanned layout on
## the 3-axis mesh, without the multi-step variants (grad_accumulation, layout) that hold
## the known divergences. `make test-maxtext MAXTEXT_SCOPE=` runs everything.
MAXTEXT_SCOPE ?= --mesh data=2,fsdp=2,tensor=2 -k 'not loop and not grad_accumulation and not test_layout'

test-maxtext: $(MAXTEXT_STAMP)
	$(MAXTEXT_VENV)/bin/python -c '$(MAXTEXT_READY)'
	$(call run-modules,$(MAXTEXT_VENV)/bin/python,$(SUITE_MODULES),--family 'maxtext-*' $(MAXTEXT_SCOPE) $(ARGS))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## Regenerate goldens for the selected tests only (ARGS narrows, e.g. ARGS='--family gpt3').
goldens: $(STAMP)
	$(BIN)/python -m pytest conformance/suite --snapshot-update $(ARGS)

goldens-maxtext: $(MAXTEXT_STAMP)
	$(MAXTEXT_VENV)/bin/python -m pytest conformance/suite --snapshot-update --family 'maxtext-*' \
	  $(MAXTEXT_SCOPE) $(ARGS)

benchmark: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV) $(MAXTEXT_VENV)
