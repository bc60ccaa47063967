# `make test` works from a fresh clone: it builds the virtual environments it needs, then runs the suite.
PYTHON ?= python3
VENV   ?= .venv
OA2    ?= .venv-openai2
PY      = $(VENV)/bin/python
PY2     = $(OA2)/bin/python
CREWAI ?= .venv-crewai
PY3     = $(CREWAI)/bin/python
PYTEST_ARGS ?=
# The simulator and the storm benchmark: the zp-sim and zp-storm distributions of this repository (sim/,
# storm/), installed editable beside zp-client in the main and openai 2.x environments (their tests are
# in pyproject.toml's testpaths; zp-client finds `zp-client sim`/`storm` through their entry points).
DISTRIBUTIONS = sim storm
EDITABLE_DISTRIBUTIONS = $(addprefix -e ,$(DISTRIBUTIONS))
DISTRIBUTION_PROJECTS = $(addsuffix /pyproject.toml,$(DISTRIBUTIONS))
# The agent-framework integrations: separate distributions in this repository (langchain-zp, autogen-zp),
# installed editable into both environments; their tests are in pyproject.toml's testpaths.
INTEGRATIONS = integrations/langchain integrations/autogen
# Installed into the main environment only (litellm is large; its tests run there): litellm-zp.
MAIN_ONLY_INTEGRATIONS = integrations/litellm
INTEGRATION_PROJECTS = $(addsuffix /pyproject.toml,$(INTEGRATIONS) $(MAIN_ONLY_INTEGRATIONS))
EDITABLE_INTEGRATIONS = $(addprefix -e ,$(INTEGRATIONS))

# What `make lint` and `make typecheck` check; integration paths are skipped until they exist. mypy
# gets the integration packages, not their tests folders (two `tests`/`conftest` modules would clash).
LINT_PATHS      ?= zp_client sim/zp_sim storm/zp_storm $(wildcard integrations)
TYPECHECK_PATHS ?= zp_client sim/zp_sim storm/zp_storm $(filter-out $(OA2_ONLY)/% integrations/crewai/%,$(wildcard integrations/*/*_zp integrations/*/src/*_zp))
# llama-index-llms-zp: LlamaIndex's openai integration needs openai < 3, so it is installed, tested and
# type-checked (mypy reading that environment's packages) in the openai 2.x environment only.
OA2_ONLY = integrations/llama-index

.PHONY: test test-fast test-wheel test-main test-others test-openai2 test-crewai test-versions faults lint typecheck demo bench clean

# The main environment: openai 3.x (built on httpx2) and every extra.
$(VENV)/.installed: pyproject.toml $(DISTRIBUTION_PROJECTS) $(INTEGRATION_PROJECTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]" $(EDITABLE_DISTRIBUTIONS) $(EDITABLE_INTEGRATIONS) $(addprefix -e ,$(MAIN_ONLY_INTEGRATIONS))
	touch $@

# A second, small environment: openai 2.x (built on httpx), for the tests marked openai_compat.
$(OA2)/.installed: pyproject.toml $(DISTRIBUTION_PROJECTS) $(INTEGRATION_PROJECTS) $(OA2_ONLY)/pyproject.toml
	$(PYTHON) -m venv $(OA2)
	$(PY2) -m pip install -q --upgrade pip
	$(PY2) -m pip install -q -e ".[redis,offline,langchain,autogen]" $(EDITABLE_DISTRIBUTIONS) $(EDITABLE_INTEGRATIONS) -e $(OA2_ONLY) "openai>=2,<3" "starlette>=0.37" "uvicorn>=0.30" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "respx>=0.21"
	touch $@

# A third environment for crewai-zp: CrewAI 1.15 pins openai<3, httpx~=0.28 and pydantic<2.13. Its tests
# serve the simulator (zp-sim), not the storm.
$(CREWAI)/.installed: pyproject.toml sim/pyproject.toml integrations/crewai/pyproject.toml
	$(PYTHON) -m venv $(CREWAI)
	$(PY3) -m pip install -q --upgrade pip
	$(PY3) -m pip install -q -e . -e sim -e integrations/crewai "pytest>=8" "pytest-timeout>=2.3"
	touch $@

# The three environments build side by side; the gates run next (a lint or type finding fails `make test`
# before the suite starts); then the main suite runs beside the two smaller ones (their output is printed
# whole, per target, as each ends), and every environment runs and reports before `make test` fails. The
# main and openai 2.x suites each run as two processes side by side (.ci/pytest-halves): the slow and fault
# tests that read the wall clock (marked `serial` by tests/conftest.py) one at a time, as before, beside
# the rest (docs/testing.md#make-test).
test:
	$(MAKE) -j3 $(VENV)/.installed $(OA2)/.installed $(CREWAI)/.installed
	$(MAKE) lint typecheck
	$(MAKE) -j2 --output-sync=target --keep-going test-main test-others

# beside the main suite: the two smaller environments, then the supported versions (test-versions below)
test-others: test-openai2 test-crewai test-versions

test-main: $(VENV)/.installed
	bash .ci/pytest-halves $(PY) '' $(PYTEST_ARGS)

test-openai2: $(OA2)/.installed
	bash .ci/pytest-halves $(PY2) openai_compat $(PYTEST_ARGS)
	$(PY2) -m pytest $(OA2_ONLY)/tests $(PYTEST_ARGS)

test-crewai: $(CREWAI)/.installed
	$(PY3) -m pytest integrations/crewai/tests $(PYTEST_ARGS)

# The edit loop: the main environment only, without the tests marked slow (the hypothesis state machines,
# the storms, anything over about a second on a loaded machine) or faults; `make test` and CI run them
# all. Two pytest-xdist workers: the tests mostly wait, so two beat one (3.6 -> 2.0 minutes on 2 cores) and
# four lose to the collection each worker repeats (2.4 minutes); docs/testing.md.
FAST_ARGS ?= -n 2
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not faults" $(FAST_ARGS) $(PYTEST_ARGS)

# The zp-client wheel alone (no zp-sim, no zp-storm, no checkout on sys.path) runs the ledger, budget,
# retry, estimate, forecast, transport and observe tests in a fresh environment of its own (.ci/test-wheel;
# the tests marked needs_sim are skipped there). Not part of `make test`: docs/testing.md.
test-wheel:
	PYTHON=$(PYTHON) bash .ci/test-wheel

# The fault-injection tests alone (SIGKILL, SIGSTOP, restarts of a redis-server of their own, a delaying
# proxy, cancellations, abandoned streams, deadlines; marked `faults`), then their results table: each
# scenario's measured over-admission, leaked blocks, time to recover and caller-visible error (rows in
# $(FAULT_REPORT), JSON lines; the table is printed at the end of pytest's output). `make test` runs them too,
# the CPU-bound 5,000-request storm at 1,000 (--full-scale: tests/conftest.py).
FAULT_REPORT ?= faults-report.jsonl
faults: $(VENV)/.installed
	rm -f $(FAULT_REPORT)
	$(PY) -m pytest -m faults --fault-report=$(FAULT_REPORT) --full-scale $(PYTEST_ARGS)

# The supported versions beyond the main environment's: the Redis, cancellation and transport tests on the
# other Pythons under pyenv (3.10, 3.12) and on redis-py's lowest allowed major (5), each in a small
# environment of its own (.ci/test-versions says what it skips; with CI=true a missing Python is an error).
# `make test` runs it beside the main suite, after the two smaller environments (on 2 cores that
# costs ~1 minute of wall time where running it after `make test` cost ~5).
test-versions:
	PYTHON=$(PYTHON) bash .ci/test-versions

# Gates (rules in pyproject.toml: [tool.ruff.lint], [tool.mypy]).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINT_PATHS)

typecheck: $(VENV)/.installed $(OA2)/.installed $(CREWAI)/.installed
	$(VENV)/bin/mypy $(TYPECHECK_PATHS)
	$(VENV)/bin/mypy --follow-imports=silent --python-executable $(PY2) $(OA2_ONLY)/llama_index_zp
	$(VENV)/bin/mypy --follow-imports=silent --python-executable $(PY3) integrations/crewai/crewai_zp

# The main job: the storm benchmark on the simulator, with and without zp-client.
demo: $(VENV)/.installed
	$(VENV)/bin/zp-client storm --workload seed-burst --out storm-report

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_budget.py

clean:
	rm -rf $(VENV) $(OA2) $(CREWAI) .venv-py3.* .venv-redis* $(FAULT_REPORT) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
