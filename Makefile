PYTHON ?= python3

.PHONY: install test demo bench lint

install:  ## install fcsd (CPU torch from the local wheel index if present) with test tools
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'

test:  ## the fast CPU test-suite (no network, no GPU)
	$(PYTHON) -m pytest tests

demo:  ## the embedded default job: a tiny model converted and probed on CPU, offline
	$(PYTHON) -m fcsd.cli demo

bench:  ## benchmarks (ratios on CPU, absolute numbers only on a GPU)
	$(PYTHON) benchmarks/run_all.py

lint:
	$(PYTHON) -m ruff check fcsd tests benchmarks
	$(PYTHON) -m ruff format --check fcsd tests benchmarks
