# Developer tasks. Each runs with the repository's virtual environment when there is one (.venv, as the README's
# set-up makes it), else with python3 on PATH. `make help` lists them.

PY ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
NPM ?= npm

.PHONY: help build format test-static test-quick test lint lint-js regen ci

# The code the formatter keeps (ruff format): the engine's package and its build script.
FORMATTED = kb_rag scripts/build_engine.py

help:
	@echo "make build        kb_engine.py, the one file users get, from the package kb_rag/"
	@echo "make format       ruff format over the package and its build script (then make build)"
	@echo "make test-static  the static tests (tables, docs, layering, contract, twins): pytest alone, seconds"
	@echo "make test-quick   every test not marked slow (about 3 minutes on 2 cores)"
	@echo "make test         the whole suite, the README's test command (CI runs it)"
	@echo "make lint         kb_engine.py is the package's build, the package is formatted, ruff check, mypy,"
	@echo "                  and make lint-js when npm is installed"
	@echo "make lint-js      ESLint over the DSH plugin's JavaScript (npm run lint in plugin/, after npm ci if needed)"
	@echo "make regen        rewrite every generated file from the code, then review the diff"
	@echo "make ci           .ci/run: a fresh virtual environment, make lint, the whole suite"

build:
	$(PY) scripts/build_engine.py

format:
	$(PY) -m ruff format $(FORMATTED)
	$(PY) scripts/build_engine.py

test-static:
	$(PY) -m pytest -q tests/static

test-quick:
	$(PY) -m pytest -q -m "not slow"

test:
	$(PY) -m pytest -q

lint:
	$(PY) scripts/build_engine.py --check
	$(PY) -m ruff format --check $(FORMATTED)
	$(PY) -m ruff check .
	$(PY) -m mypy
	@if command -v $(NPM) >/dev/null 2>&1; then $(MAKE) --no-print-directory lint-js; \
	else echo "npm not found: the plugin's JavaScript is not linted (make lint-js)"; fi

# `npm ls` fails when a pinned development dependency is missing or at another version: then install the lock file.
lint-js:
	cd plugin && { $(NPM) ls --depth=0 >/dev/null 2>&1 || $(NPM) ci --no-audit --no-fund; } && $(NPM) run lint

# Generated files: PROTOCOL.md's request tables, README's environment table, DESIGN.md's contents,
# host-contract.json (KB_UPDATE_DOCS=1 over the static tests); the rendering cases' expected Markdown and views;
# the host conformance cases; the DSH plugin's tool-schema snapshot (KB_UPDATE_SNAPSHOT=1 over its tests).
regen: build
	KB_UPDATE_DOCS=1 $(PY) -m pytest -q tests/static tests/test_rendering.py
	$(PY) tests/conformance_cases.py
	cd plugin && PATH="$(abspath $(dir $(PY))):$$PATH" KB_UPDATE_SNAPSHOT=1 $(NPM) test

ci:
	bash .ci/run
