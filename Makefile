# blockrt: every target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= test

.PHONY: demo test bench lint clean venv

$(VENV)/.installed-$(EXTRAS): setup.cfg setup.py pyproject.toml allocators/_speedups.c \
		examples/plugin_allocator/setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet -e examples/plugin_allocator
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

# The main demo trains an MLP on scikit-learn's digits (examples/sharing_memory.py tells the
# aliasing story: run it with $(PY) examples/sharing_memory.py).
demo:
	$(MAKE) venv EXTRAS=demo
	$(PY) examples/train_mlp.py

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m pip install --quiet ruff
	$(VENV)/bin/ruff check backends allocators runtime tests examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis allocators/*.so

# Benchmarks compare against pyopencl's pool on PoCL and against PyTorch CPU, so they install the
# opencl extra and torch (benchmark-only; exactly 2.13.0, the CPU build these machines carry).
bench:
	$(MAKE) venv EXTRAS=test,opencl
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) benchmarks/bench_alloc.py
	$(PY) benchmarks/bench_trace.py
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_train.py --check
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_graph.py
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_opencl.py
