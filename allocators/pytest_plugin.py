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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from allocators.base import Allocator

#: The device every command-line conformance test runs on.
DEVICE = "cpu"


def run_conformance(factory: Callable[[], Allocator], **settings: Any) -> None:
    """Run the conformance state machine on `factory()` allocators; raise on any failure.

    Keyword arguments go to `allocators.testing.make_test_case` (max_examples,
    stateful_step_count, any hypothesis setting).
    """
    from allocators.testing import make_test_case

    test_case = make_test_case(factory, **settings)
    test_case("runTest").runTest()


class ConformanceItem(pytest.Item):
    """The test `blockrt-conformance[NAME]`: the kit on `allocators.create(NAME, "cpu")`."""

    def __init__(self, *, allocator_name: str, max_examples: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allocator_name = allocator_name
        self.max_examples = max_examples

    def runtest(self) -> None:
        import allocators

        name = self.allocator_name
        run_conformance(lambda: allocators.create(name, DEVICE), max_examples=self.max_examples)

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


@pytest.hookimpl(tryfirst=True)  # NOTE: before -k / -m deselection, so those select ours too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    max_examples = config.getoption("blockrt_max_examples")
    for name in dict.fromkeys(config.getoption("blockrt_allocators")):
        items.append(ConformanceItem.from_parent(session, name=f"blockrt-conformance[{name}]",
                                                 allocator_name=name, max_examples=max_examples))


@pytest.fixture
def blockrt_allocator_conformance() -> Callable[..., None]:
    """`run_conformance(factory, **settings)`: the kit on allocators that `factory()` builds."""
    return run_conformance
