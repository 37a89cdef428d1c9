"""Groups of processes that train together: MPI through mpi4py (MPICH from PyPI by default).

`init()` returns the group of every process of the job (`mpiexec -n N python train.py`): its
`rank` and `size`, and the collectives that `nn.DistributedDataParallel` and
`nn.ZeroRedundancyOptimizer` need, on host NumPy buffers: non-blocking all-reduce,
reduce-scatter and all-gather (each a `Work` to wait on), and a blocking broadcast. blockrt
has no transport of its own; a device whose memory is not the host's is staged through host
buffers by the callers (runtime/parallel.py).

Note [a collective never hangs]: every wait on a collective is a loop that tests the
requests (which also drives MPI's progress), looks for a failure notice from another rank, and
gives up after the group's `timeout`. A rank whose Python code raises past the top of the
script tells the others first (`init` wraps `sys.excepthook`: `Group.fail`), so their waits
raise `RankFailedError` naming it at once; a rank that dies without a word is caught by the
launcher (MPICH's mpiexec ends the whole job when a process exits abnormally) or, where the
launcher keeps the others running (`mpiexec -disable-auto-cleanup`), by the timeout:
`CollectiveTimeoutError` names the collective, its size, the elapsed time and the group. After
either error the group is broken: every later collective refuses at once, and the process
leaves with `os._exit` instead of MPI's finalize, which would wait for the lost rank. It
waits a second first: MPICH's launcher ends the whole job as soon as one process exits with an
error, and the others should have said why by then. The
callers start every collective of a step before their first write to state and wait for all of
them before it (Note [the commit point] in runtime/nn.py), so a failed collective leaves
parameters, gradients and optimizer state as they were.

Example (run under `mpiexec -n 2`; a single process is a group of one):
    >>> from runtime import distributed
    >>> group = distributed.init()
    >>> group.rank < group.size
    True
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
import time
from typing import Any

import numpy as np

__all__ = ["CollectiveTimeoutError", "DistributedError", "Group", "RankFailedError", "Work",
           "init", "mpiexec"]

#: seconds a collective may take before `CollectiveTimeoutError`, unless `init(timeout=)` or
#: the environment (`BLOCKRT_DIST_TIMEOUT`, read once, by `init`) says otherwise
DEFAULT_TIMEOUT = 300.0

#: the environment variable that sets the default timeout
TIMEOUT_ENV = "BLOCKRT_DIST_TIMEOUT"

#: the tag of failure notices on the group's control communicator
_FAILED = 17


class DistributedError(RuntimeError):
    """A collective of a group failed; the group is broken and the step changed nothing."""


class RankFailedError(DistributedError):
    """Another rank of the group raised (or its collective failed) and said so."""


class CollectiveTimeoutError(DistributedError):
    """A collective did not complete within the group's timeout (a rank died or stalled)."""


class Work:
    """One started non-blocking collective: `wait()` for it (Note [a collective never hangs]),
    `test()` whether it is done (which also moves MPI along)."""

    def __init__(self, group: Group, request: Any, what: str, nbytes: int) -> None:
        self.group = group
        self.request = request
        #: e.g. "all-reduce of bucket 2", for messages
        self.what = what
        self.nbytes = nbytes
        #: perf_counter() at the start, and when it was first seen complete (None until then)
        self.started = time.perf_counter()
        self.completed: float | None = None

    def test(self) -> bool:
        """True once the collective is complete (its buffers may then be read and reused)."""
        if self.completed is None:
            with self.group._lock:  # NOTE: MPI forbids testing one request from two threads
                self._test_locked()
        return self.completed is not None

    def _test_locked(self) -> bool:
        if self.completed is None and self.request.Test():
            self.completed = time.perf_counter()
        return self.completed is not None

    def wait(self) -> None:
        """Wait for the collective: Note [a collective never hangs].

        Raises:
            RankFailedError, CollectiveTimeoutError: as `Group.wait_all`.
        """
        self.group.wait_all([self])

    def __repr__(self) -> str:
        state = "done" if self.completed is not None else "in flight"
        return f"<Work {self.what}, {self.nbytes} bytes, {state}>"


class Group:
    """The processes of one job, over an MPI communicator (`init()` makes it).

    Attributes:
        rank: this process's index, 0 <= rank < size.
        size: the number of processes.
        timeout: seconds any collective may take (Note [a collective never hangs]).
    """

    def __init__(self, comm: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        #: the collectives' own communicator, and one for failure notices only (a notice
        #: can never be taken for a collective's message)
        self._comm = comm.Dup()
        self._control = comm.Dup()
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        if not timeout > 0:
            raise ValueError(f"distributed: timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
        self.timeout = float(timeout)
        #: why the group is broken (a message), or None while it works
        self.broken: str | None = None
        #: started collectives not yet seen complete (tested by `progress`)
        self._in_flight: list[Work] = []
        #: Note [progress in the background]: whether a helper thread tests the collectives
        #: in flight while `poll_in_background(True)` holds, and how often (seconds)
        self.background_progress = True
        self.poll_interval = 2e-4
        self._lock = threading.Lock()
        self._polling = threading.Event()
        self._poller: threading.Thread | None = None

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buffer: np.ndarray, what: str = "all-reduce") -> Work:
        """Start summing `buffer` (contiguous, on the host) over the ranks, in place."""
        self._usable(what)
        request = self._comm.Iallreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM)
        return self._started(request, what, buffer.nbytes)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray,
                       what: str = "reduce-scatter") -> Work:
        """Start summing `send` over the ranks; rank r receives part r of the sum in `recv`
        (`send.size == size * recv.size`)."""
        self._usable(what)
        if send.size != self.size * recv.size:
            raise ValueError(f"{what}: send has {send.size} elements, which is not {self.size} "
                             f"ranks x {recv.size} received")
        request = self._comm.Ireduce_scatter_block(send, recv, op=self._mpi.SUM)
        return self._started(request, what, send.nbytes)

    def allgather(self, send: np.ndarray, recv: np.ndarray, what: str = "all-gather") -> Work:
        """Start gathering every rank's `send` into `recv`, rank r's at part r
        (`recv.size == size * send.size`)."""
        self._usable(what)
        if recv.size != self.size * send.size:
            raise ValueError(f"{what}: recv has {recv.size} elements, which is not {self.size} "
                             f"ranks x {send.size} sent")
        request = self._comm.Iallgather(send, recv)
        return self._started(request, what, recv.nbytes)

    def broadcast(self, buffer: np.ndarray, root: int = 0, what: str = "broadcast") -> None:
        """Copy rank `root`'s `buffer` into every rank's, in place; waits for it."""
        self._usable(what)
        request = self._comm.Ibcast(buffer, root=root)
        self.wait_all([self._started(request, what, buffer.nbytes)])

    def barrier(self) -> None:
        """Wait until every rank has reached this call (Note [a collective never hangs])."""
        self._usable("barrier")
        self.wait_all([self._started(self._comm.Ibarrier(), "barrier", 0)])

    # ------------------------------------------------------------------ waiting
    def progress(self) -> None:
        """Test every collective in flight: MPI moves a non-blocking collective on only inside
        its own calls, so the callers test while they compute (a backward pass, between
        gradients) for the transfers to overlap the computation."""
        if self._in_flight:
            with self._lock:
                self._in_flight = [w for w in self._in_flight if not w._test_locked()]

    def poll_in_background(self, on: bool) -> None:
        """Start (True) or stop (False) testing the collectives in flight from a helper
        thread, every `poll_interval` seconds: Note [progress in the background]. Nothing
        where `background_progress` is False."""
        if not on:
            self._polling.clear()
            return
        if not self.background_progress:
            return
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="blockrt-mpi-progress",
                                            daemon=True)
            self._poller.start()
        self._polling.set()

    # Note [progress in the background]: MPICH moves a non-blocking collective on only
    # inside an MPI call of the process, and a transfer through shared memory takes several
    # (a 4 MiB all-reduce of two ranks about 6, each doing a share of the copies and sums).
    # Tested only between gradients, a bucket started in backward moves on a few times and
    # completes in the wait after backward. So while the reducer has buckets in flight, a
    # helper thread tests them every `poll_interval`: it runs while the main thread is in a
    # product or a NumPy kernel (both release the GIL), which is where backward spends its
    # time. Tests hold the group's lock (MPI forbids testing one request from two threads
    # at once; mpi4py initialises MPI_THREAD_MULTIPLE). The thread waits on an event when
    # there is nothing to do, and makes no MPI call then (so MPI's finalize never meets it).
    def _poll(self) -> None:
        while True:
            self._polling.wait()
            if self._in_flight:
                self.progress()
            else:
                self._polling.clear()
            time.sleep(self.poll_interval)

    def wait_all(self, works: list[Work]) -> None:
        """Wait until every work of `works` is complete: Note [a collective never hangs].

        Raises:
            RankFailedError: another rank failed and said so.
            CollectiveTimeoutError: they took longer than `timeout` seconds.
        """
        pending = [work for work in works if not work.test()]
        if not pending:
            self.progress()
            return
        start = time.perf_counter()
        spins = 0
        while pending:
            self._check_notices()
            waited = time.perf_counter() - start
            if waited > self.timeout:
                first = pending[0]
                self._break(
                    f"rank {self.rank}: {first.what} ({first.nbytes} bytes) did not complete "
                    f"within {self.timeout:g} s (group of {self.size}, {len(pending)} "
                    f"collective(s) pending): another rank died or stalled")
                raise CollectiveTimeoutError(self.broken)
            spins += 1
            if spins > 200:  # NOTE: spin briefly (latency), then let the other ranks run
                time.sleep(min(1e-3, 1e-5 * (spins - 200)))
            pending = [work for work in pending if not work.test()]
        self.progress()

    def _check_notices(self) -> None:
        control, status = self._control, self._mpi.Status()
        if control.Iprobe(source=self._mpi.ANY_SOURCE, tag=_FAILED, status=status):
            message = control.recv(source=status.Get_source(), tag=_FAILED)
            self._break(f"rank {status.Get_source()} failed: {message}")
            raise RankFailedError(f"rank {self.rank}: {self.broken}; this rank's step stopped "
                                  f"before its first write, so its state is as it was")

    # ------------------------------------------------------------------ failure
    def fail(self, error: BaseException | str) -> None:
        """Tell every other rank that this one failed (their waits then raise
        `RankFailedError` naming it), and mark the group broken. Never raises."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.broken is None:
            self._break(f"this rank ({self.rank}) failed: {text}")
        for other in range(self.size):
            if other != self.rank:
                try:
                    # NOTE: a few hundred bytes go eagerly: send returns at once, even to a
                    # rank that is waiting inside a collective
                    self._control.send(text, dest=other, tag=_FAILED)
                except Exception:
                    pass

    def _break(self, why: str) -> None:
        self._polling.clear()
        # NOTE: a rank gives the others a moment to report before it leaves: the launcher
        # may end the job as soon as one process exits with an error
        _grace[0] = max(_grace[0], min(GRACE_SECONDS, self.timeout))
        if self.broken is None:
            self.broken = why
            _leave_hard.add(id(self))

    def _usable(self, what: str) -> None:
        if self.broken is not None:
            raise DistributedError(f"rank {self.rank}: {what} refused: the group is broken "
                                   f"({self.broken})")

    def _started(self, request: Any, what: str, nbytes: int) -> Work:
        work = Work(self, request, what, nbytes)
        with self._lock:
            self._in_flight.append(work)
        return work

    def __repr__(self) -> str:
        state = "" if self.broken is None else ", broken"
        return f"<Group rank {self.rank} of {self.size} (MPI){state}>"


#: ids of groups that broke: the process then leaves without MPI's finalize, which would wait
#: for the rank that failed (Note [a collective never hangs])
_leave_hard: set[int] = set()
_world: Group | None = None


#: seconds a rank whose group broke waits before it leaves (Note [a collective never hangs])
GRACE_SECONDS = 1.0
_grace = [0.0]


def _exit_hook() -> None:
    if _leave_hard:
        time.sleep(_grace[0])
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)


def _tell_others(kind: type, value: BaseException, trace: Any) -> None:
    """sys.excepthook while a group lives: tell the other ranks first, then the usual report."""
    group = _world
    if group is not None and not isinstance(value, KeyboardInterrupt):
        group.fail(value)
    _previous_hook(kind, value, trace)


_previous_hook = sys.excepthook


def init(backend: str = "mpi", timeout: float | None = None) -> Group:
    """The group of every process of this job (one per `mpiexec` rank; a script started
    without mpiexec is a group of one), made at the first call and returned again later.

    `timeout` is how long any collective may take, in seconds (default `BLOCKRT_DIST_TIMEOUT`
    from the environment, else 300): Note [a collective never hangs].

    Raises:
        ValueError: an unknown backend, or a timeout that is not a positive number.
        ImportError: mpi4py is not installed (`pip install mpi4py mpich`).
    """
    global _world, _previous_hook
    if backend != "mpi":
        raise ValueError(f"distributed.init: unknown backend {backend!r}; blockrt's groups "
                         f"run over MPI (backend='mpi')")
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, "") or str(DEFAULT_TIMEOUT)
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"distributed.init: the timeout must be a positive number of "
                         f"seconds, got {timeout!r}")
    if _world is not None:
        _world.timeout = float(timeout)
        return _world
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise ImportError("distributed.init needs mpi4py and an MPI library: pip install "
                          "mpi4py mpich (or blockrt[mpi])") from error
    group = Group(MPI.COMM_WORLD, timeout)
    _world = group
    if sys.excepthook is not _tell_others:
        _previous_hook, sys.excepthook = sys.excepthook, _tell_others
    # NOTE: registered after mpi4py's own finalize (imported above), so it runs before it
    atexit.register(_exit_hook)
    return group


def mpiexec() -> str:
    """The path of the MPI launcher to start ranks with: the `mpiexec` beside this Python (the
    `mpich` wheel installs it there), else the first on PATH.

    Raises:
        FileNotFoundError: there is none (pip install mpi4py mpich).
    """
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec beside this Python or on PATH: pip install mpi4py "
                                "mpich (or blockrt[mpi])")
    return found
