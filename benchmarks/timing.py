"""Side-by-side timing for the benchmarks: interleaved rounds, best round kept."""

from __future__ import annotations

import timeit
from collections.abc import Callable


def interleaved_min(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The smallest value each measure returns over `rounds` rounds.

    Every round runs each measure in turn, so all of them see the same machine load (these
    machines switch between speeds for seconds at a time; sequential runs would not compare).
    """
    best = dict.fromkeys(measures, float("inf"))
    for _ in range(rounds):
        for name, measure in measures.items():
            best[name] = min(best[name], measure())
    return best


def interleaved_best(contenders: dict[str, Callable[[], object]], number: int,
                     rounds: int) -> dict[str, float]:
    """Microseconds per call of each contender: the best round of `number` calls.

    Each contender is called once first to warm up (first-touch allocation, caches).
    """
    for fn in contenders.values():
        fn()

    def per_call(fn: Callable[[], object]) -> Callable[[], float]:
        return lambda: timeit.timeit(fn, number=number) / number * 1e6

    return interleaved_min({name: per_call(fn) for name, fn in contenders.items()}, rounds)
