# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL ?= ../shared/models/stories260K

.PHONY: install test demo lint proto proto-check bench bench-all clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

proto: install
	$(PY) -m pdserve.protogen

proto-check: install
	$(PY) -m pdserve.protogen --check

lint: install
	$(PY) -m ruff check .

# pytest exits 5 when it collects nothing; make treats any non-zero exit as failure.
test: install proto-check lint
	$(PY) -m pytest -q -rs tests  # -rs: say why anything was skipped

demo: install
	$(PY) -m pdserve.cli demo --config configs/local.yaml --model $(MODEL)

bench: install
	$(PY) bench/engine.py

# All benchmarks (about 10 minutes on 2 cores); JSON and PNGs land in bench/out/.
bench-all: bench
	$(PY) bench/transfer.py
	$(PY) bench/disagg_vs_colocated.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
