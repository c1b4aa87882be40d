# All set-up is done here: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL  ?= smollm2-135m-instruct
PYTEST_ARGS ?=
# pytest-xdist workers: one per core, at most 4 (each holds a few GiB of compiled programs);
# 0 = in this process. Each test file runs whole on one worker.
# A test that runs longer than this fails loudly (its worker's stacks are dumped and the worker is
# replaced) instead of a hung worker leaving the whole run to the other one.
TEST_TIMEOUT ?= 1200
JOBS   ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: test demo venv install clean test-all browser

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,serve,bench]'
	touch $@

install: $(VENV)/.installed

# Debian's chromium for the page test (tests/test_server.py); skipped there if this cannot install it
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
	  { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	    >/dev/null 2>&1 || echo "could not install chromium: the browser test will be skipped" >&2; }

test: install browser
	XLA_FLAGS="$${XLA_FLAGS:---xla_force_host_platform_device_count=8}" $(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder \
	  --timeout $(TEST_TIMEOUT) --timeout-method thread --durations 25 $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder -m 'not gpu' $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/jaxspec fetch $(MODEL) --dir checkpoints
	$(VENV)/bin/jaxspec generate checkpoints/$(MODEL) --chat \
	  --prompt "What is the capital of France?" \
	  --prompt "Write a haiku about the sea." --max-new-tokens 48

clean:
	rm -rf $(VENV)
