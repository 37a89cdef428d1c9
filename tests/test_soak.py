"""Soak mode: BLOCKRT_SOAK multiplies every hypothesis test's example count (docs/testing.md).

The scaling is checked end to end: a small test module runs in a pytest subprocess with the
variable set, and `--hypothesis-show-statistics` must report the multiplied counts, for `@given`
tests with and without their own settings, parametrized ones (scaled once, not once per
parameter), a state machine's TestCase, and the allocator conformance kit (collected, and through
the plugin's fixture). It runs three ways: through the blockrt pytest plugin alone (what a
third-party allocator author gets), through tests/conftest.py alone (plugin autoloading off),
and through both (which must still scale once).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from allocators.pytest_plugin import SOAK_DEFAULT_FACTOR, SOAK_ENV, soak_factor

ROOT = Path(__file__).resolve().parent.parent

#: A module of hypothesis tests with known example counts; none of them can stop early (their
#: strategies have far more values than examples).
PROBE = '''
    import pytest
    from hypothesis import given, settings, strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    import allocators
    from allocators.testing import make_test_case


    @given(st.integers())
    @settings(max_examples=7, database=None)
    def test_seven(x):
        pass


    @given(st.binary())
    def test_profile(x):
        pass


    @pytest.mark.parametrize("n", [1, 2])
    @given(st.integers())
    @settings(max_examples=3, database=None)
    def test_three(n, x):
        pass


    class Counter(RuleBasedStateMachine):
        @rule(k=st.integers())
        def step(self, k):
            pass


    TestCounter = Counter.TestCase
    TestCounter.settings = settings(max_examples=4, stateful_step_count=2, database=None)
    TestKit = make_test_case(lambda: allocators.create("direct", "cpu"), max_examples=2,
                             stateful_step_count=2, database=None)
'''
#: Uses the plugin's fixture and counts the kit's machines (two allocators each). Hypothesis may
#: start a few machines more than it counts as examples, so this count is a lower bound check.
FIXTURE_PROBE = '''
    import allocators


    def test_fixture(blockrt_allocator_conformance):
        made = []

        def factory():
            made.append(1)
            return allocators.create("direct", "cpu")

        blockrt_allocator_conformance(factory, max_examples=2, stateful_step_count=2,
                                      database=None)
        print(f"FIXTURE MACHINES {len(made) // 2}")
'''
#: Each probe test and its example count without soak mode (hypothesis's default is 100).
BASE_COUNTS = {"test_seven": 7, "test_profile": 100, "test_three[1]": 3, "test_three[2]": 3,
               "TestCounter::runTest": 4, "TestKit::runTest": 2}


def run_probe(tmp_path: Path, soak: str | None, *, plugin: bool, conftest: bool,
              fixture: bool = True) -> tuple[int, str]:
    """Run the probe module(s) under pytest in a subprocess; return (exit code, output)."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    if fixture:
        (tmp_path / "test_fixture_probe.py").write_text(textwrap.dedent(FIXTURE_PROBE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop(SOAK_ENV, None)
    if soak is not None:
        env[SOAK_ENV] = soak
    args = ["-p", "no:cacheprovider", "-s", "--hypothesis-show-statistics", str(tmp_path)]
    if plugin:
        env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    else:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        args = ["-p", "_hypothesis_pytestplugin", *args]  # NOTE: hypothesis's own, by name
    if conftest:
        args = ["-p", "conftest", *args]  # NOTE: tests/conftest.py, found on PYTHONPATH
    done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


def example_counts(output: str) -> dict[str, int]:
    """Test name -> passing examples, from `--hypothesis-show-statistics` output."""
    counts = {}
    for name, body in re.findall(r"^\S+?::(\S+):\n(.*?)(?=^\S|\Z)", output, re.M | re.S):
        passing = re.findall(r"- (\d+) passing", body)
        counts[name] = sum(int(n) for n in passing)
    return counts


def fixture_machines(output: str) -> int:
    """How many state machines the fixture probe's conformance run started."""
    found = re.search(r"FIXTURE MACHINES (\d+)", output)
    assert found, output[-3000:]
    return int(found.group(1))


# ---------------------------------------------------------------------- the setting
@pytest.mark.parametrize(("value", "factor"), [
    (None, 1), ("", 1), ("  ", 1), ("1", SOAK_DEFAULT_FACTOR), ("true", SOAK_DEFAULT_FACTOR),
    ("Yes", SOAK_DEFAULT_FACTOR), ("ON", SOAK_DEFAULT_FACTOR), ("2", 2), (" 25 ", 25),
])
def test_soak_factor_reads_the_variable(value, factor):
    environ = {} if value is None else {SOAK_ENV: value}
    assert soak_factor(environ) == factor


@pytest.mark.parametrize("value", ["banana", "0", "-3", "2.5", "1e3", "false", "off", "x10",
                                   "\u0663"])
def test_a_bad_soak_value_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"{SOAK_ENV}={re.escape(repr(value))}"):
        soak_factor({SOAK_ENV: value})


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize(("plugin", "conftest"), [(True, False), (False, True), (True, True)],
                         ids=["plugin", "conftest", "both"])
def test_soak_multiplies_every_example_count(tmp_path, plugin, conftest):
    code, output = run_probe(tmp_path, "3", plugin=plugin, conftest=conftest, fixture=plugin)
    assert code == 0, output[-3000:]
    expected = {name: 3 * n for name, n in BASE_COUNTS.items()}
    assert example_counts(output) == expected, output[-3000:]
    if plugin:
        assert fixture_machines(output) >= 3 * 2


@pytest.mark.slow
def test_soak_one_means_tenfold_and_unset_means_off(tmp_path):
    code, output = run_probe(tmp_path, None, plugin=True, conftest=True)
    assert code == 0, output[-3000:]
    assert example_counts(output) == BASE_COUNTS, output[-3000:]
    assert fixture_machines(output) < SOAK_DEFAULT_FACTOR * 2
    assert "soak mode" not in output
    code, output = run_probe(tmp_path, "1", plugin=True, conftest=True)
    assert code == 0, output[-3000:]
    expected = {name: SOAK_DEFAULT_FACTOR * n for name, n in BASE_COUNTS.items()}
    assert example_counts(output) == expected, output[-3000:]
    assert fixture_machines(output) >= SOAK_DEFAULT_FACTOR * 2
    assert f"blockrt soak mode: {SOAK_DEFAULT_FACTOR}x hypothesis examples" in output


@pytest.mark.parametrize(("value", "plugin", "conftest"), [
    ("banana", True, False), ("0", True, False), ("-3", True, False), ("banana", False, True)],
    ids=["banana-plugin", "0-plugin", "-3-plugin", "banana-conftest"])
def test_a_bad_soak_value_stops_pytest_with_its_name(tmp_path, value, plugin, conftest):
    code, output = run_probe(tmp_path, value, plugin=plugin, conftest=conftest, fixture=False)
    assert code == pytest.ExitCode.USAGE_ERROR, output[-3000:]
    assert f"{SOAK_ENV}={value!r} is not a soak setting" in output, output[-3000:]
    assert "passed" not in output
