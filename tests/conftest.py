"""Shared test settings: hypothesis profiles and a fresh runtime state for every test."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import runtime

settings.register_profile("default", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("default"), print_blob=True)
# tests/test_conformance.py reruns the runtime's suites on each non-cpu backend with this profile
settings.register_profile("conformance", parent=settings.get_profile("ci"), max_examples=25)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(autouse=True)
def _aliasing_mode_restored():
    """Every test starts in the default "copy" aliasing mode, whatever the last one left."""
    old = runtime.set_aliasing("copy")
    yield
    runtime.set_aliasing(old)
