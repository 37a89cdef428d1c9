"""Side-by-side timing for the benchmarks: interleaved rounds, best round kept."""

from __future__ import annotations

import timeit
from collections.abc import Callable


def interleaved_best(contenders: dict[str, Callable[[], object]], number: int,
                     rounds: int) -> dict[str, float]:
    """Microseconds per call of each contender, the best of `rounds` rounds of `number` calls.

    Every round times each contender in turn, so all of them see the same machine load; each is
    called once first to warm up (first-touch allocation, caches).
    """
    for fn in contenders.values():
        fn()
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(rounds):
        for name, fn in contenders.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best
