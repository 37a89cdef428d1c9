"""Example ceilings (tests/conftest.py, `CEILINGS`): under `--hypothesis-profile=quick` (`make
check`) no hypothesis test runs more than 5 examples, its own `@settings` included; under the
normal profiles none runs more than the largest count a test asks for today, so the suite's time
stays bounded as tests are added; soak mode multiplies a test's own count and has no ceiling.

Checked end to end, as tests/test_soak.py checks soak mode: its probe module (tests with known
counts, a state machine, the allocator kit) and one test asking for more than the ceiling run
in a pytest subprocess, through tests/conftest.py, and `--hypothesis-show-statistics` must
report the capped counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
from test_soak import BASE_COUNTS, PROBE, example_counts

ROOT = Path(__file__).resolve().parent.parent

#: A test asking for more examples than any profile's ceiling.
GREEDY = '''
    from hypothesis import given, settings, strategies as st


    @given(st.integers())
    @settings(max_examples=CEILING + 100, database=None)
    def test_greedy(x):
        pass
'''


def run(tmp_path: Path, *args: str, soak: str | None = None) -> dict[str, int]:
    """The probe modules under pytest, through tests/conftest.py alone; example counts."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    ceiling = conftest.CEILINGS["default"]
    (tmp_path / "test_greedy.py").write_text(textwrap.dedent(GREEDY).replace("CEILING",
                                                                              str(ceiling)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for name in ("PYTEST_ADDOPTS", "BLOCKRT_SOAK", "CI"):
        env.pop(name, None)
    if soak is not None:
        env["BLOCKRT_SOAK"] = soak
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                           "_hypothesis_pytestplugin", "-p", "no:cacheprovider",
                           "--hypothesis-show-statistics", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return example_counts(done.stdout)


def test_the_quick_profile_runs_every_property_at_most_five_times(tmp_path):
    counts = run(tmp_path, "--hypothesis-profile=quick")
    quick = conftest.CEILINGS["quick"]
    assert quick == 5
    expected = {name: min(n, quick) for name, n in BASE_COUNTS.items()}
    assert counts == {**expected, "test_greedy": quick}


def test_a_normal_run_stops_at_the_ceiling_and_soak_mode_does_not(tmp_path):
    ceiling = conftest.CEILINGS["default"]
    assert conftest.CEILINGS["ci"] == ceiling
    assert run(tmp_path) == {**BASE_COUNTS, "test_greedy": ceiling}
    soaked = run(tmp_path, soak="2")
    assert soaked == {**{name: 2 * n for name, n in BASE_COUNTS.items()},
                      "test_greedy": 2 * (ceiling + 100)}
