"""A pytest plugin that runs blockrt's allocator conformance kit (`allocators.testing`).

Installing blockrt registers it under the `pytest11` entry point `blockrt_allocators`, so pytest
loads it by itself. With PYTEST_DISABLE_PLUGIN_AUTOLOAD set, name it: `-p blockrt_allocators`.
(`-p allocators.pytest_plugin` works only while autoloading is off: with it on, pytest would
register the module a second time, under the entry point's name, and stop.)

An allocator author has two ways in.

1. From the command line, for any name that `allocators.names()` lists (an entry point in group
   `blockrt.allocators`, or a name passed to `allocators.register` in a conftest.py)::

       pytest --blockrt-allocator=buddy

   adds the test `blockrt-conformance[buddy]`, the kit's state machine on
   `allocators.create("buddy", "cpu")`. Repeat the option for more names;
   `--blockrt-max-examples=N` sets how many random programs each runs (default 50).

2. In a test module, with the `blockrt_allocator_conformance` fixture, which is
   `run_conformance(factory, **hypothesis_settings)`::

       from blockrt_buddy import BuddyAllocator

       def test_buddy_conforms(blockrt_allocator_conformance):
           blockrt_allocator_conformance(lambda: BuddyAllocator("cpu", arena_nbytes=1 << 16))

   The factory must return a new allocator on every call. A broken allocator fails the test
   with hypothesis's smallest failing program.

Without `--blockrt-allocator` the plugin only adds its options and the fixture: it adds no tests,
and the kit (with hypothesis) is imported only when a conformance run starts.

Soak mode. With the environment variable BLOCKRT_SOAK set, every hypothesis test in the run tries
more examples: the conformance tests above, and every other `@given` test or state machine that
pytest collects, including those whose `@settings(max_examples=...)` chose their own count.
`BLOCKRT_SOAK=1` (or `true`, `yes`, `on`) means ten times as many; a whole number N >= 2 means N
times as many; unset or empty means off. Any other value (`0`, `-3`, `banana`) stops pytest with
an error naming the variable and the value. See docs/testing.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from allocators.base import Allocator

#: The device every command-line conformance test runs on.
DEVICE = "cpu"
#: The environment variable that turns soak mode on (see the module docstring).
SOAK_ENV = "BLOCKRT_SOAK"
#: How many times as many examples `BLOCKRT_SOAK=1` (or true, yes, on) asks for.
SOAK_DEFAULT_FACTOR = 10
_SOAK_WORDS = ("1", "true", "yes", "on")
#: Where a test's original settings are kept once soak mode has scaled them, so that scaling
#: twice (this plugin and a conftest.py both calling soak_items) scales once.
_SOAK_BASE = "_blockrt_soak_base_settings"
_soak_factor_key = pytest.StashKey[int]()


def soak_factor(environ: Mapping[str, str] | None = None) -> int:
    """How many times as many hypothesis examples to run, from BLOCKRT_SOAK in `environ`
    (default: os.environ): 1 when unset or empty, 10 for 1/true/yes/on, N for a whole number
    N >= 2.

    Raises:
        ValueError: any other value; the message names the variable and the value.

    Example:
        >>> [soak_factor({"BLOCKRT_SOAK": value}) for value in ("", "true", "3")]
        [1, 10, 3]
    """
    raw = (os.environ if environ is None else environ).get(SOAK_ENV, "")
    value = raw.strip().lower()
    if not value:
        return 1
    if value in _SOAK_WORDS:
        return SOAK_DEFAULT_FACTOR
    if value.isascii() and value.isdigit() and int(value) >= 2:
        return int(value)
    raise ValueError(f"environment variable {SOAK_ENV}={raw!r} is not a soak setting: use 1, "
                     f"true, yes or on for {SOAK_DEFAULT_FACTOR} times the hypothesis examples, "
                     f"a whole number N >= 2 for N times, or leave it unset (or empty) for none")


def soak_items(items: list[pytest.Item], factor: int, ceiling: int | None = None) -> int:
    """Multiply the `max_examples` of every hypothesis test among `items` by `factor`, and
    with `ceiling`, let none run more than `ceiling` examples (a quick run; tests/conftest.py).

    Covers `@given` tests (their own `@settings` or the profile's) and hypothesis state machine
    TestCases (their `settings` class attribute). The original settings are kept beside the
    scaled ones and every scaling starts from them, so calling this twice scales once. Returns
    how many tests were scaled.
    """
    if factor == 1 and ceiling is None:
        return 0
    from hypothesis import settings as Settings

    scaled: set[int] = set()
    for item in items:
        test = getattr(item, "obj", None)
        test = getattr(test, "__func__", test)  # a method's settings live on its function
        cls = getattr(item, "cls", None)
        if cls is not None and hasattr(test, "_hypothesis_state_machine_class"):
            owner, attribute = cls, "settings"  # a RuleBasedStateMachine's TestCase
        elif getattr(test, "is_hypothesis_test", False):
            owner, attribute = test, "_hypothesis_internal_use_settings"
        else:
            continue
        if id(owner) in scaled:  # NOTE: parametrized items share one function
            continue
        scaled.add(id(owner))
        base = vars(owner).get(_SOAK_BASE) or getattr(owner, attribute)
        setattr(owner, _SOAK_BASE, base)
        examples = base.max_examples * factor
        if ceiling is not None:
            examples = min(examples, ceiling)
        setattr(owner, attribute, Settings(base, max_examples=examples))
    return len(scaled)


def run_conformance(factory: Callable[[], Allocator], *, soak: int = 1, **settings: Any) -> None:
    """Run the conformance state machine on `factory()` allocators, and on OpenCL the queue
    check (`allocators.testing.check_queue_ordered_reuse`); raise on any failure.

    Keyword arguments go to `allocators.testing.make_test_case` (max_examples,
    stateful_step_count, any hypothesis setting); `soak` multiplies max_examples (the plugin's
    fixture and command-line tests pass BLOCKRT_SOAK's factor).
    """
    from allocators.testing import check_queue_ordered_reuse, make_test_case

    test_case = make_test_case(factory, soak=soak, **settings)
    test_case("runTest").runTest()
    check_queue_ordered_reuse(factory)  # checks nothing off OpenCL


class ConformanceItem(pytest.Item):
    """The test `blockrt-conformance[NAME]`: the kit on `allocators.create(NAME, "cpu")`."""

    def __init__(self, *, allocator_name: str, max_examples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allocator_name = allocator_name
        self.max_examples = max_examples

    def runtest(self) -> None:
        import allocators

        name = self.allocator_name
        run_conformance(lambda: allocators.create(name, DEVICE), max_examples=self.max_examples,
                        soak=self.config.stash[_soak_factor_key])

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"blockrt allocator conformance: {self.allocator_name}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("blockrt", "blockrt allocator conformance")
    group.addoption("--blockrt-allocator", action="append", default=[], metavar="NAME",
                    dest="blockrt_allocators",
                    help="run the allocator conformance kit on allocators.create(NAME, 'cpu'); "
                         "repeat for more allocators")
    group.addoption("--blockrt-max-examples", type=int, default=50, metavar="N",
                    dest="blockrt_max_examples",
                    help="random programs per --blockrt-allocator test (default 50)")


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: the environment is read once, here; a bad value stops the run before collection.
    try:
        config.stash[_soak_factor_key] = soak_factor()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)  # NOTE: before -k / -m deselection, so those select ours too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    max_examples = config.getoption("blockrt_max_examples")
    for name in dict.fromkeys(config.getoption("blockrt_allocators")):
        items.append(ConformanceItem.from_parent(session, name=f"blockrt-conformance[{name}]",
                                                 allocator_name=name, max_examples=max_examples))
    soak_items(items, config.stash[_soak_factor_key])


@pytest.fixture
def blockrt_allocator_conformance(pytestconfig: pytest.Config) -> Callable[..., None]:
    """`run_conformance(factory, **settings)`: the kit on allocators that `factory()` builds
    (with BLOCKRT_SOAK's factor applied)."""
    return functools.partial(run_conformance, soak=pytestconfig.stash[_soak_factor_key])
