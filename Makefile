# blockrt: every target creates (or reuses) its own virtual environment in .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= test

.PHONY: demo test check bench lint clean venv asan

$(VENV)/.installed-$(EXTRAS): setup.cfg setup.py pyproject.toml allocators/_speedups.c \
		runtime/_dispatch.c backends/_halfconv.c backends/_pool.h backends/_torchalloc.c backends/optable.py backends/_halfconv_gen.py \
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

# `make check`: the fast loop while iterating (README: under 2 minutes on two cores). One test
# file or more of each package (allocators, backends with OpenCL, runtime with graph, amp and
# nn, the command line, the docs' pages and the namespace), every property at most 5 examples
# (the `quick` hypothesis profile, tests/conftest.py), without the slow reruns and the demo
# trained to 97% in mixed precision. `make test` runs everything with the full counts.
CHECK_TESTS ?= tests/test_allocators.py tests/test_caching.py tests/test_adaptors.py \
               tests/test_speedups.py tests/test_backends.py tests/test_opencl.py \
               tests/test_tensor.py tests/test_ops.py tests/test_autograd.py tests/test_nn.py \
               tests/test_graph.py tests/test_planner.py tests/test_amp.py tests/test_config.py \
               tests/test_cli.py tests/test_docs.py tests/test_namespace.py
check: venv
	$(PY) -m pytest -q -p no:cacheprovider --hypothesis-profile=quick -m "not slow" \
		-k "not reaches_97_percent" $(CHECK_TESTS) $(PYTEST_ARGS)

# `make asan`: the C hot path (allocators/_speedups.c), the ops' fast path (runtime/_dispatch.c)
# and the half conversions (backends/_halfconv.c)
# built with AddressSanitizer and UndefinedBehaviorSanitizer, and the allocator and op tests run
# against them (needs gcc, ASAN_CC).
# - The builds go into copies of the allocators and runtime packages in $(ASAN_DIR), first on
#   PYTHONPATH, so .venv keeps its normal build; a check that they are the extensions Python
#   loads comes first.
# - libasan must be the first library of the process, so it is preloaded into Python, and
#   libstdc++ with it: ASan looks up the C++ runtime's __cxa_throw when it starts, and a
#   libstdc++ that pyopencl's extension brings in later leaves it unresolved, so the first C++
#   exception (pyopencl raising an OpenCL error) aborts in ASan's interceptor.
# - ASan's dlopen interceptor calls dlopen itself, so the caller's RUNPATH is lost: the OpenCL
#   loader in pyopencl's wheel then cannot find the PoCL driver beside it (no platform, the
#   OpenCL tests skip). LD_LIBRARY_PATH names that folder, and a check that the sanitized
#   process sees the backends the normal one sees comes first.
# - CPython leaks by design: no leak reports. Tests ask for a PiB to see OutOfMemoryError: malloc
#   returns NULL (NumPy raises MemoryError) instead of ASan aborting. Any UB report stops the run.
# - pytest captures sys.stdout / sys.stderr only (--capture=sys), so a sanitizer's report, which
#   C writes to file descriptor 2 before it aborts the process, reaches the terminal.
# - The slow tests rerun test files in pure-Python mode (no extension), so they are left out.
ASAN_CC    ?= gcc
ASAN_DIR   := build/asan
ASAN_TESTS ?= tests/test_speedups.py tests/test_caching.py tests/test_allocators.py \
              tests/test_threads.py tests/test_adaptors.py tests/test_races.py \
              tests/test_fastpath.py tests/test_ops.py tests/test_autograd.py tests/test_nn.py \
              tests/test_halfconv.py tests/test_conv.py tests/test_pool.py
ASAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
# The libraries of pyopencl's wheel (its OpenCL loader and PoCL), if it is installed.
ASAN_OPENCL_LIBS = $(shell $(PY) -c 'import importlib.util as u; s = u.find_spec("pyopencl"); \
                   print(s.submodule_search_locations[0] + "/.libs" if s else "")')
# NOTE: PYTHONSAFEPATH: the working directory, first on sys.path, would give the normal build
ASAN_ENV    = PYTHONSAFEPATH=1 PYTHONPATH=$(abspath $(ASAN_DIR)) \
              LD_PRELOAD="$$($(ASAN_CC) -print-file-name=libasan.so) \
                          $$($(ASAN_CC) -print-file-name=libstdc++.so)" \
              LD_LIBRARY_PATH=$(ASAN_OPENCL_LIBS)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
              ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
              UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ASAN_BUILD  = $(ASAN_CC) -shared -fPIC $(ASAN_FLAGS) \
              -I$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
EXT_SUFFIX  = $$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')

asan: venv
	rm -rf $(ASAN_DIR)
	mkdir -p $(ASAN_DIR)/allocators $(ASAN_DIR)/runtime $(ASAN_DIR)/backends
	cp allocators/*.py $(ASAN_DIR)/allocators/
	cp -r runtime/*.py runtime/graph $(ASAN_DIR)/runtime/
	cp backends/*.py $(ASAN_DIR)/backends/
	$(ASAN_BUILD) allocators/_speedups.c -o $(ASAN_DIR)/allocators/_speedups$(EXT_SUFFIX)
	$(ASAN_BUILD) runtime/_dispatch.c -o $(ASAN_DIR)/runtime/_dispatch$(EXT_SUFFIX)
	$(ASAN_BUILD) backends/_halfconv.c -o $(ASAN_DIR)/backends/_halfconv$(EXT_SUFFIX)
	$(ASAN_ENV) $(PY) -c "import allocators, allocators._core as core, runtime; \
		from runtime import fastpath; from backends import numpy as cpu; \
		paths = [core.speedups.__file__ if allocators.ACCELERATED else 'no extension', \
		         fastpath._dispatch.__file__ if fastpath.ACCELERATED else 'no extension', \
		         cpu._halfconv.__file__ if cpu._halfconv else 'no extension']; \
		bad = [p for p in paths if not p.startswith('$(abspath $(ASAN_DIR))/')]; \
		assert not bad, f'not the sanitized builds: {bad}'; \
		print('sanitized extensions in use:', *paths); \
		import backends; seen = backends.available(); \
		want = '$$($(PY) -c 'import backends; print(*backends.available())')'.split(); \
		assert seen == want, f'backends: {seen} sanitized, {want} without ASan'; \
		print('backends:', *seen)"
	for so in $(ASAN_DIR)/allocators/_speedups*.so $(ASAN_DIR)/runtime/_dispatch*.so \
	          $(ASAN_DIR)/backends/_halfconv*.so; do \
		nm -D $$so | grep -q __asan_init && nm -D $$so | grep -q __ubsan_handle_ || exit 1; done
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
	$(MAKE) venv EXTRAS=test,opencl,mkl
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) benchmarks/bench_alloc.py
	$(PY) benchmarks/bench_trace.py
	$(PY) benchmarks/bench_dispatch.py
	$(PY) benchmarks/bench_train.py --check
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_graph.py
	$(PY) benchmarks/bench_budget.py
	$(PY) benchmarks/bench_planner.py
	$(PY) benchmarks/bench_opencl.py
	$(PY) benchmarks/bench_queues.py
	$(PY) benchmarks/bench_half.py
