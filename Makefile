# All set-up is done here: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL  ?= smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: test demo venv install clean test-all

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,serve,bench]'
	touch $@

install: $(VENV)/.installed

test: install
	XLA_FLAGS="$${XLA_FLAGS:---xla_force_host_platform_device_count=8}" $(PY) -m pytest -q $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -m 'not gpu' $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/jaxspec fetch $(MODEL) --dir checkpoints
	$(VENV)/bin/jaxspec generate checkpoints/$(MODEL) --chat \
	  --prompt "What is the capital of France?" \
	  --prompt "Write a haiku about the sea." --max-new-tokens 48

clean:
	rm -rf $(VENV)
