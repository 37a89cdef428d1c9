"""Shared test settings: hypothesis profiles, soak mode and a fresh runtime state for every test.

Soak mode (BLOCKRT_SOAK, see docs/testing.md) multiplies every hypothesis test's example count,
those with their own `@settings(max_examples=...)` included. The blockrt pytest plugin does it
when pytest loads it by its entry point; the hooks here do it too, so a run with plugin
autoloading off (PYTEST_DISABLE_PLUGIN_AUTOLOAD) soaks as well. Scaling twice scales once.

Outside soak mode each profile has a ceiling (`CEILINGS`): no test runs more examples than it,
its own `@settings` included. `--hypothesis-profile=quick` (`make check`) runs every property
a few times; under the others the ceiling is the largest count a test asks for today, so a new
test cannot make the suite's time grow without bound: more examples belong to soak mode.
"""

from __future__ import annotations

import gc
import os

import pytest
from hypothesis import HealthCheck, settings

import runtime
from allocators.pytest_plugin import soak_factor, soak_items

settings.register_profile("default", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("default"), print_blob=True)
# tests/test_conformance.py reruns the runtime's suites on each non-cpu backend with this profile
settings.register_profile("conformance", parent=settings.get_profile("ci"), max_examples=25)
# `make check`: every property a few times, to iterate fast (the full counts run in `make test`)
settings.register_profile("quick", parent=settings.get_profile("default"), max_examples=5)
PROFILE = "ci" if os.environ.get("CI") else "default"
settings.load_profile(PROFILE)
#: The most examples one test runs under each profile outside soak mode (see the docstring).
CEILINGS = {"quick": 5, "default": 300, "ci": 300}

_soak = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: BLOCKRT_SOAK is read once, here; a bad value stops the run with its name and value.
    try:
        config.stash[_soak] = soak_factor()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    factor = config.stash[_soak]
    profile = config.getoption("hypothesis_profile", None) or PROFILE
    soak_items(items, factor, CEILINGS.get(profile) if factor == 1 else None)


def pytest_report_header(config: pytest.Config) -> str | None:
    factor = config.stash[_soak]
    return f"blockrt soak mode: {factor}x hypothesis examples" if factor > 1 else None


@pytest.fixture(autouse=True)
def _aliasing_mode_restored():
    """Every test starts in the default "copy" aliasing mode, whatever the last one left."""
    old = runtime.set_aliasing("copy")
    yield
    runtime.set_aliasing(old)


@pytest.fixture(autouse=True)
def _earlier_objects_frozen():
    """What exists before a test is moved out of the cycle collector's reach while it runs
    (`gc.freeze`, O(1)), so a test that calls `gc.collect()` per example (to count frees) walks
    its own objects only: in a whole-suite process, with everything earlier tests, PyTorch and
    hypothesis keep alive, such a test ran 8x slower than alone (136 s against 17 s)."""
    gc.freeze()
    yield
    gc.unfreeze()
