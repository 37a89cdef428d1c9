"""The shared test helpers do what the tests rely on."""

from __future__ import annotations

import threading

import pytest

from helpers import run_threads


def test_run_threads_runs_every_worker_at_once_and_reraises_a_worker_error():
    seen = set()

    def work(index: int) -> None:
        seen.add((index, threading.get_ident()))
        if index == 2:
            raise KeyError("worker 2 failed")

    with pytest.raises(KeyError, match="worker 2 failed"):
        run_threads(work, 4)
    assert {index for index, _ in seen} == {0, 1, 2, 3}
    assert len({ident for _, ident in seen}) == 4  # all alive together: four distinct threads
