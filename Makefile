# Two commands on a fresh machine: `make demo` and `make test`.
#
# SGLang release: the newest of the supported window by default; any release with a
# constraints file is selectable, in its own venv: `make test SGLANG=0.5.17`.
SGLANG_DEFAULT := 0.5.23
SGLANG ?= $(SGLANG_DEFAULT)
PY ?= python3
VENV := $(if $(filter $(SGLANG),$(SGLANG_DEFAULT)),.venv,.venv-$(SGLANG))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# constraints/sglang-X.txt is the environment the suite passed with on release X (pip
# freeze), installed as it is: no resolution, so a fresh install is reproducible, pip does not
# backtrack through sglang's CUDA extras, and 0.5.18-0.5.22 install at all (they pin
# cuda-tile==1.6.0rc5, which PyPI serves only as a stub that fails to build; their files
# hold cuda-tile 1.7.0). Each SGLang pins its own torch; sglang-hs pins none.
CONSTRAINTS := constraints/sglang-$(SGLANG).txt
# The streaming sinks' producer code, in the runtime's venv: hs-connectors (speculators'
# transport, its own Mooncake producer) and Mooncake's client and master (the non-CUDA wheel
# runs over TCP on any machine; it loads three Debian libraries even for TCP, see MOONCAKE_LIBS).
STREAMING := hs-connectors==0.9.0 mooncake-transfer-engine-non-cuda==0.3.13.post1
MOONCAKE_LIBS := libibverbs1 libnl-3-200 libnl-route-3-200
# SGLang's load balancer (Rust, its own wheel; its Python side needs only what SGLang already
# has), for capture through a router (docs/scale-out.md) and its tests.
ROUTER := sglang-router==0.3.2
# A constraints file may say how pip must fetch it ("# pip-args: ..." on its first lines).
PIP_ARGS = $(shell sed -n 's/^# pip-args: //p' $(CONSTRAINTS))
# The trainers whose own loaders read our converted output in the tests, at the versions we
# pin. Installed apart (--no-deps into their own folder, put on sys.path by the tests), since
# they pin other sglang/transformers versions than the runtime's; the two packages below them
# are the only imports the runtime's environment lacks.
TRAINERS := .cache/trainers
TRAINERS_STAMP := $(TRAINERS)/.installed
# The subset run on every release of the window besides the newest (CI: 0.5.17): unit tests,
# seam conformance, and the server tests marked `core` (exactness vs HF under chunked
# prefill and the prefix cache, every CPU family, TP2, a signal fault, start-up refusals).
CORE := core or not (server or gpu or multigpu)

.PHONY: demo test test-core test-unit canary venv clean

$(CONSTRAINTS):
	@echo "no constraints file for SGLang $(SGLANG): releases with one: $(notdir $(wildcard constraints/*.txt))" >&2
	@echo "(make canary SGLANG=$(SGLANG) checks a new release first)" >&2
	@exit 1

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install $(PIP_ARGS) --no-deps -r $(CONSTRAINTS)
	$(BIN)/pip install -q --no-deps $(STREAMING) $(ROUTER)
	$(BIN)/pip install -q --no-deps -e .
	@ldconfig -p | grep -q libnl-route-3.so.200 && ldconfig -p | grep -q libibverbs.so.1 || \
		{ [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq $(MOONCAKE_LIBS); } || \
		{ echo "Mooncake needs the Debian packages $(MOONCAKE_LIBS): apt-get install them (as root)" >&2; exit 1; }
	touch $(STAMP)

$(TRAINERS_STAMP): Makefile | $(STAMP)
	rm -rf $(TRAINERS)
	$(BIN)/pip install -q --no-deps --target $(TRAINERS) specforge==0.2.0 speculators==0.9.0 \
		hs-connectors==0.9.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
	touch $(TRAINERS_STAMP)

venv: $(STAMP) $(TRAINERS_STAMP)

demo: $(STAMP)
	$(BIN)/sglang-hs demo

# Two test modules at a time (pytest-xdist), each module in one worker (its servers are module
# fixtures), modules with more tests first (xdist's default): a server test spends most of its
# minute starting SGLang, one process importing at a time, so two overlap well even on 2 cores
# (25:48 vs about 34 minutes one by one; server modules first instead took longer, each
# pairing two servers on 2 cores; again 2026-12-07: stopped at 28 minutes with the router and
# TP modules and most unit modules still to run, past the default's 33:39 on that machine).
# PYTEST_WORKERS=0 runs them one by one.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -v -rs

test: $(STAMP) $(TRAINERS_STAMP)
	$(PYTEST) --durations=25

test-core: $(STAMP) $(TRAINERS_STAMP)
	$(PYTEST) --durations=25 -m "$(CORE)"

test-unit: $(STAMP) $(TRAINERS_STAMP)
	$(PYTEST) -m "not server and not gpu and not multigpu"

# A release not yet supported (or any in the window): install it from PyPI into a scratch
# venv and run the seam conformance probe, printing what changed (docs/releases.md).
canary:
	$(PY) -m harness.canary $(SGLANG)

clean:
	rm -rf .venv .venv-* .cache
