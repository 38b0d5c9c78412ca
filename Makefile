# `make test`: create .venv if missing, install jdspark with its test extra, run the suite.
# `make test-fast`: the same without the tests marked slow (`-m "not slow"`).
# `make serve`: the same set-up, then the OpenAI-compatible server on the embedded model (CPU is fine).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-fast serve install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Two worker processes (the CI machine has 2 cores; XLA compiles on one thread; times in the README).
# --dist loadfile keeps each test file, and so its module fixtures, in one worker.
# `make test` runs every test (CI too); `make test-fast` leaves out those marked slow, for the edit loop.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=15

serve: $(STAMP)
	$(PY) -m jdspark.cli serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
