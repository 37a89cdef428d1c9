# blockrt: every target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= test

.PHONY: demo test bench lint clean venv asan

$(VENV)/.installed-$(EXTRAS): setup.cfg setup.py pyproject.toml allocators/_speedups.c \
		runtime/_dispatch.c \
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

# `make asan`: the C hot path (allocators/_speedups.c) built with AddressSanitizer and
# UndefinedBehaviorSanitizer, and the allocator tests run against it (needs gcc, ASAN_CC).
# - The build goes into a copy of the allocators package in $(ASAN_DIR), first on PYTHONPATH, so
#   .venv keeps its normal build; a check that it is the extension Python loads comes first.
# - libasan must be the first library of the process, so it is preloaded into Python.
# - CPython leaks by design: no leak reports. Tests ask for a PiB to see OutOfMemoryError: malloc
#   returns NULL (NumPy raises MemoryError) instead of ASan aborting. Any UB report stops the run.
# - pytest captures sys.stdout / sys.stderr only (--capture=sys), so a sanitizer's report, which
#   C writes to file descriptor 2 before it aborts the process, reaches the terminal.
# - The slow tests rerun test files in pure-Python mode (no extension), so they are left out.
ASAN_CC    ?= gcc
ASAN_DIR   := build/asan
ASAN_TESTS ?= tests/test_speedups.py tests/test_caching.py tests/test_allocators.py \
              tests/test_threads.py tests/test_adaptors.py tests/test_races.py
ASAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
# NOTE: PYTHONSAFEPATH: the working directory, first on sys.path, would give the normal build
ASAN_ENV    = PYTHONSAFEPATH=1 PYTHONPATH=$(abspath $(ASAN_DIR)) \
              LD_PRELOAD=$$($(ASAN_CC) -print-file-name=libasan.so) \
              ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
              UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

asan: venv
	rm -rf $(ASAN_DIR)
	mkdir -p $(ASAN_DIR)/allocators
	cp allocators/*.py $(ASAN_DIR)/allocators/
	$(ASAN_CC) -shared -fPIC $(ASAN_FLAGS) \
		-I$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
		allocators/_speedups.c -o $(ASAN_DIR)/allocators/_speedups$$($(PY) -c \
		'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	$(ASAN_ENV) $(PY) -c "import allocators, allocators._core as core; \
		path = core.speedups.__file__ if allocators.ACCELERATED else 'no extension'; \
		assert path.startswith('$(abspath $(ASAN_DIR))/'), f'not the sanitized build: {path}'; \
		print('sanitized extension in use:', path)"
	nm -D $(ASAN_DIR)/allocators/_speedups*.so | grep -q __asan_init
	nm -D $(ASAN_DIR)/allocators/_speedups*.so | grep -q __ubsan_handle_
	$(ASAN_ENV) $(PY) -m pytest -p no:cacheprovider --capture=sys -m "not slow" $(ASAN_TESTS) \
		$(PYTEST_ARGS)

# ruff is pinned: a new release's new rules must not fail CI on unchanged code. It reads
# ruff.toml and skips what .gitignore ignores (.venv, build).
RUFF_VERSION ?= 0.17.6
lint: venv
	$(PY) -m pip install --quiet ruff==$(RUFF_VERSION)
	$(VENV)/bin/ruff check .

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
	$(PY) benchmarks/bench_queues.py
