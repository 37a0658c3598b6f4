# One entry point for people and CI. `make parity` and `make test` set up .venv on first use.
PYTHON ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
## MaxText (optional extra) lives in its own venv, so `make test` never needs it.
## MAXTEXT picks the release: 0.2.5, MaxText's current one (Linen deleted: its Linen side is
## the ToLinen bridge around the NNX model, gated against 0.2.4's recorded references), or
## 0.2.4, the last with its own Linen. Each has its own venv and constraints file.
MAXTEXT ?= 0.2.5
MAXTEXT_VENV := .venv-maxtext-$(MAXTEXT)
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed
MAXTEXT_CONSTRAINTS := constraints-maxtext-$(MAXTEXT).txt

## TIER chooses how much of the suite runs: smoke, default or full (see docs/tiers.md).
TIER ?= default
BUILTIN := --family gpt3 --family llama --family moe
## REPORT=DIR writes report.json, report.md, report.html and junit.xml there, merged over
## every process that writes to DIR (see docs/reports.md).
REPORT ?=
REPORT_ARG := $(if $(REPORT),--report=$(abspath $(REPORT)))
## CACHE=DIR turns jax's persistent compilation cache on, in DIR, for every run below:
## a program compiled once is read back by later runs (see docs/development.md, "The persistent
## compilation cache is opt-in" for why it is off by default).
CACHE ?=
ifneq ($(CACHE),)
export JAX_COMPILATION_CACHE_DIR := $(abspath $(CACHE))
export JAX_ENABLE_COMPILATION_CACHE := true
endif

.PHONY: setup setup-maxtext setup-tpu setup-maxtext-tpu parity test test-maxtext test-tpu \
	test-maxtext-tpu test-wheel upgrade-report multihost lint docs goldens goldens-maxtext \
	goldens-tpu goldens-maxtext-tpu benchmark clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup-maxtext: $(MAXTEXT_STAMP)

$(MAXTEXT_STAMP): pyproject.toml constraints.txt $(MAXTEXT_CONSTRAINTS)
	$(PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet -c constraints.txt \
	  -c $(MAXTEXT_CONSTRAINTS) -e '.[dev,maxtext]'
	touch $(MAXTEXT_STAMP)

## libtpu (the `tpu` extra) lives in its own venv too: it compiles for TPU slices on this
## host (`--tpu`), and `make setup` stays as light as before. JAX_PLATFORMS=cpu keeps jax
## from looking for a TPU to run on; libtpu only compiles, so processes that load it side by
## side (CI's TPU lanes) may share it: ALLOW_MULTIPLE_LIBTPU_LOAD, as MaxText's CPU CI sets.
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed
COMPILE_ONLY := JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=true
TPU_RUN := $(COMPILE_ONLY) $(TPU_VENV)/bin/python
## TPU: the slices `make test-tpu` compiles for (see docs/tpu.md).
TPU ?= default
## The checks that compile for TPU slices: costs and fit, and activation shardings.
TPU_CHECKS := tpu_compile or activation_sharding_tpu

## MaxText compiled for TPU slices: maxtext $(MAXTEXT) with libtpu, in a venv of its own,
## so that the MaxText venv above stays as CI's per-change lanes use it.
MAXTEXT_TPU_VENV := .venv-maxtext-$(MAXTEXT)-tpu
MAXTEXT_TPU_STAMP := $(MAXTEXT_TPU_VENV)/.installed
MAXTEXT_TPU_RUN := $(COMPILE_ONLY) $(MAXTEXT_TPU_VENV)/bin/python

setup-tpu: $(TPU_STAMP)

$(TPU_STAMP): pyproject.toml constraints.txt constraints-tpu.txt
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TPU_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-tpu.txt \
	  -e '.[dev,tpu]'
	touch $(TPU_STAMP)

setup-maxtext-tpu: $(MAXTEXT_TPU_STAMP)

$(MAXTEXT_TPU_STAMP): pyproject.toml constraints.txt $(MAXTEXT_CONSTRAINTS) constraints-tpu.txt
	$(PYTHON) -m venv $(MAXTEXT_TPU_VENV)
	$(MAXTEXT_TPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_TPU_VENV)/bin/python -m pip install --quiet -c constraints.txt \
	  -c $(MAXTEXT_CONSTRAINTS) -c constraints-tpu.txt -e '.[dev,maxtext,tpu]'
	touch $(MAXTEXT_TPU_STAMP)

constraints-maxtext-%.txt:
	@echo "error: MAXTEXT=$* is not a release this harness supports (constraints-maxtext-<release>.txt: $(patsubst constraints-maxtext-%.txt,%,$(wildcard constraints-maxtext-*.txt)))" >&2; exit 2

## WORKERS: how many processes `make parity` and `make test` run on (pytest-xdist; the
## suite keeps each group of tests on one worker); default: one per core, at most 4.
## 1 runs in this process, as CI does (.ci/run).
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
WORKERS_ARG := $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS))

## The main job: the built-in families' parity run, a progress line per family x check,
## then the agreement matrix. Exit 5 (nothing selected) is a failure too.
parity: $(STAMP)
	$(BIN)/python -m conformance $(BUILTIN) --tier $(TIER) $(WORKERS_ARG) $(REPORT_ARG) $(ARGS)

## The parity run, then the harness's own tests (units and the planted-fault catalogue,
## at the same tier); fails if either fails, including pytest's exit 5 (nothing collected).
## On workers, tests/ is dealt out by module (--dist loadfile): the planted faults, and the
## benign variants, keep the programs of the sides they leave unchanged for the next one,
## which a module spread over workers compiles on each.
test: $(STAMP)
	@status=0; \
	$(BIN)/python -m conformance $(BUILTIN) --tier $(TIER) $(WORKERS_ARG) $(REPORT_ARG) \
	  $(ARGS) || status=$$?; \
	$(BIN)/python -m pytest -p no:cacheprovider tests --conformance-tier $(TIER) $(WORKERS_ARG) \
	  $(if $(WORKERS_ARG),--dist loadfile) \
	  $(if $(REPORT),--conformance-report=$(abspath $(REPORT))) || status=$$?; \
	exit $$status

## The built-in families' smoke tier as an emulated 2-host run: 2 processes of 4 CPU
## devices each, joined by jax.distributed (see docs/multihost.md).
## MULTIHOST_CHECKS narrows it, as a pytest -k expression, and MULTIHOST_FAMILIES to some
## of the built-in families (CI's per-change run does both).
MULTIHOST_CHECKS ?=
MULTIHOST_FAMILIES ?= gpt3 llama moe

multihost: $(STAMP)
	$(BIN)/python -m conformance --processes 2 --devices-per-process 4 \
	  $(foreach f,$(MULTIHOST_FAMILIES),--family $(f)) \
	  --tier smoke $(if $(MULTIHOST_CHECKS),-k '$(MULTIHOST_CHECKS)') $(REPORT_ARG) $(ARGS)

## The MaxText families alone, in the venv of maxtext $(MAXTEXT) (the default run skips
## them there). Named families that cannot run here (maxtext missing or of a release the
## adapter does not support) are a usage error, never a run of skips.
## MAXTEXT_FAMILIES narrows the run (CI splits the four families over two processes).
MAXTEXT_FAMILIES ?= maxtext-*

test-maxtext: $(MAXTEXT_STAMP)
	$(MAXTEXT_VENV)/bin/python -m conformance $(foreach f,$(MAXTEXT_FAMILIES),--family '$(f)') \
	  --tier $(TIER) $(REPORT_ARG) $(ARGS)

## The built-in families compiled for TPU slices by libtpu, at the tier's sizes, then the
## TPU planted faults: nothing runs on a TPU, none is needed.
test-tpu: $(TPU_STAMP)
	@status=0; \
	$(TPU_RUN) -m conformance $(BUILTIN) --tier $(TIER) --tpu $(TPU) -k '$(TPU_CHECKS)' \
	  $(REPORT_ARG) $(ARGS) || status=$$?; \
	$(TPU_RUN) -m pytest -p no:cacheprovider tests/faults -k '$(TPU_CHECKS)' --conformance-tier $(TIER) \
	  --conformance-tpu $(TPU) $(if $(REPORT),--conformance-report=$(abspath $(REPORT))) \
	  || status=$$?; \
	exit $$status

## The MaxText families compiled for TPU slices by libtpu: `--tpu $(TPU)` (by default the
## device size on v6e:2x4, each production size on v5p:4x4x4 or where the family's
## Topologies feature places it), against the goldens of maxtext $(MAXTEXT). Nightly in CI.
test-maxtext-tpu: $(MAXTEXT_TPU_STAMP)
	$(MAXTEXT_TPU_RUN) -m conformance $(foreach f,$(MAXTEXT_FAMILIES),--family '$(f)') \
	  --tier $(TIER) --tpu $(TPU) -k tpu_compile $(REPORT_ARG) $(ARGS)

## What changed from maxtext 0.2.4 to $(MAXTEXT): the MaxText families' recorded_* checks
## (this release's numbers against 0.2.4's recorded references), then the golden and
## checkpoint changes, as the "Release upgrade" section of the report in UPGRADE_REPORT
## (default: REPORT, else reports/upgrade). UPGRADE_RUN=0 adds the section to a report whose
## run already holds those checks (CI's MaxText processes).
UPGRADE_REPORT ?= $(if $(REPORT),$(REPORT),reports/upgrade)
UPGRADE_RUN ?= 1

upgrade-report: $(MAXTEXT_STAMP)
	$(if $(filter 1,$(UPGRADE_RUN)),$(MAXTEXT_VENV)/bin/python -m conformance --family 'maxtext-*' \
	  -k recorded --tier $(TIER) --report $(abspath $(UPGRADE_REPORT)) $(ARGS))
	$(MAXTEXT_VENV)/bin/python -m conformance.upgrade --family 'maxtext-*' \
	  --report $(abspath $(UPGRADE_REPORT))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## The docs site: Sphinx with MyST, into docs/_build/html, every warning an error. Its
## checks and options tables are written from the check registry and the option table.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) constraints-docs.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -c constraints-docs.txt -e '.[dev,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build --quiet --fail-on-warning --keep-going --builder html docs docs/_build/html
	@echo "docs: $(abspath docs/_build/html/index.html)"

## Regenerate goldens for the selected tests only (ARGS narrows, e.g. ARGS='--family gpt3').
## Only golden tests run (-m golden), at the full tier, so every golden the suite claims is written.
goldens: $(STAMP)
	$(BIN)/python -m conformance -m golden --snapshot-update --tier full $(ARGS)

goldens-tpu: $(TPU_STAMP)
	$(TPU_RUN) -m conformance $(BUILTIN) -m golden --snapshot-update --tier full --tpu $(TPU) \
	  -k '$(TPU_CHECKS)' $(ARGS)

goldens-maxtext: $(MAXTEXT_STAMP)
	$(MAXTEXT_VENV)/bin/python -m conformance -m golden --snapshot-update --family 'maxtext-*' \
	  --tier $(TIER) $(ARGS)

goldens-maxtext-tpu: $(MAXTEXT_TPU_STAMP)
	$(MAXTEXT_TPU_RUN) -m conformance -m golden --snapshot-update \
	  $(foreach f,$(MAXTEXT_FAMILIES),--family '$(f)') --tier full --tpu $(TPU) -k tpu_compile $(ARGS)

## The package as a user installs it, without a clone: build the wheel, install it with
## the pinned versions in a fresh venv, and run the built-in families' smoke-tier goldens,
## recorded references and structure checks from an empty directory (their goldens and
## references must come from the installed package): every check with a golden or a
## reference, and none without (`sharding_invariance`, `explicit_sharding` and the mode
## pairs, which compare two modes of NNX with each other, keep neither).
WHEEL_VENV := .venv-wheel
WHEEL_CHECKS ?= (structure or (sharding and not invariance) or recorded) \
  and not (explicit_sharding or graph-vs-tree or auto-vs-explicit)

## The wheel is built from a copy of the tree: building in place rewrites the
## *.egg-info beside the sources, which every `python -m conformance` started in this
## directory reads its entry points from (a run beside it found no family).
WHEEL_SOURCE_IGNORE := ".git", ".venv*", "build", "dist", "reports", "*.egg-info", "__pycache__"

test-wheel: $(STAMP)
	rm -rf dist $(WHEEL_VENV)
	@source="$$(mktemp -d)"; status=0; \
	  $(BIN)/python -c 'import shutil, sys; shutil.copytree(".", sys.argv[1], dirs_exist_ok=True, \
	  ignore=shutil.ignore_patterns($(WHEEL_SOURCE_IGNORE)))' "$$source" && \
	  $(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir "$(abspath dist)" "$$source" \
	  || status=$$?; rm -rf "$$source"; exit $$status
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet -c constraints.txt dist/*.whl
	@empty="$$(mktemp -d)"; status=0; cd "$$empty" && \
	  $(abspath $(WHEEL_VENV))/bin/python -m conformance $(BUILTIN) --tier smoke \
	  -k '$(WHEEL_CHECKS)' $(REPORT_ARG) $(ARGS) || status=$$?; \
	  rm -rf "$$empty"; exit $$status

benchmark: $(STAMP)
	$(BIN)/python scripts/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV) .venv-maxtext-* $(TPU_VENV) $(WHEEL_VENV) build dist docs/_build docs/_generated
