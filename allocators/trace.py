"""The allocation trace format: events, JSON lines, the loader and the replay benchmark.

A `TraceAdaptor` (allocators.adaptors) records every successful alloc and free of the allocator
it wraps as a `TraceEvent`; `write_jsonl` writes events as JSON lines (one object per event),
`load_trace` reads them back with every line checked, and `replay` runs a trace's allocs and
frees against any allocator and times them, so a trace taken from a real workload is a benchmark
(benchmarks/bench_trace.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from allocators.base import Allocation, Allocator

__all__ = ["TraceEvent", "load_trace", "replay", "write_jsonl"]


class TraceEvent(NamedTuple):
    """One alloc or free seen by a TraceAdaptor (one line of its JSON-lines export)."""

    #: "alloc" or "free"
    action: str
    #: the allocation's serial in the traced adaptor; pairs a free with its alloc
    serial: int
    #: bytes requested
    nbytes: int
    #: bytes set aside (after upstream rounding)
    size: int
    #: allocation.ptr, the device address of the first byte
    address: int
    #: time.monotonic_ns() when it happened
    time_ns: int
    #: threading.get_ident() of the caller
    thread: int


_ACTIONS = ("alloc", "free")


def write_jsonl(events: Sequence[TraceEvent], path_or_file: str | Path | IO[str]) -> int:
    """Write `events` as JSON lines (one object per event) to a path or a text file; returns how
    many were written."""
    text = "".join(json.dumps(event._asdict(), separators=(",", ":")) + "\n"
                   for event in events)
    if hasattr(path_or_file, "write"):
        path_or_file.write(text)
    else:
        Path(path_or_file).write_text(text, encoding="utf-8")
    return len(events)


def _parse_event(line: str, where: str) -> TraceEvent:
    """One JSON line -> TraceEvent; ValueError naming `where` for anything malformed."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON line ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [field for field in TraceEvent._fields if field not in record]
    if missing:
        raise ValueError(f"{where}: the event lacks {', '.join(missing)}")
    if record["action"] not in _ACTIONS:
        raise ValueError(f"{where}: action must be 'alloc' or 'free', got {record['action']!r}")
    for field in TraceEvent._fields[1:]:
        value = record[field]
        if type(value) is not int or value < 0:
            raise ValueError(f"{where}: {field} must be a non-negative integer, got {value!r}")
    if record["size"] < record["nbytes"]:
        raise ValueError(f"{where}: size {record['size']} is smaller than nbytes "
                         f"{record['nbytes']}")
    return TraceEvent(**{field: record[field] for field in TraceEvent._fields})


def _check_sequence(events: Sequence[TraceEvent], where: Callable[[int], str]) -> None:
    """Every free pairs with an earlier alloc of the same serial; no serial is live twice."""
    live: set[int] = set()
    for index, event in enumerate(events):
        if event.action == "alloc":
            if event.serial in live:
                raise ValueError(f"{where(index)}: allocation #{event.serial} is allocated "
                                 f"again while still live")
            live.add(event.serial)
        elif event.serial in live:
            live.remove(event.serial)
        else:
            raise ValueError(f"{where(index)}: free of allocation #{event.serial}, which is not "
                             f"live at that point (never allocated, or already freed)")


def load_trace(path_or_file: str | Path | IO[str]) -> list[TraceEvent]:
    """Read a TraceAdaptor's JSON-lines export (blank lines are skipped; extra keys ignored).

    Raises:
        ValueError: a malformed line, or a free of a serial that is not live; the message
            names the file and line.
    """
    if hasattr(path_or_file, "read"):
        text = path_or_file.read()
        name = getattr(path_or_file, "name", "<trace>")
    else:
        text = Path(path_or_file).read_text(encoding="utf-8")
        name = str(path_or_file)
    events: list[TraceEvent] = []
    line_numbers: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            events.append(_parse_event(line, f"{name} line {number}"))
            line_numbers.append(number)
    _check_sequence(events, lambda index: f"{name} line {line_numbers[index]}")
    return events


def replay(trace: Sequence[TraceEvent] | str | Path | IO[str], allocator: Allocator,
           repeat: int = 1) -> dict[str, Any]:
    """Run a trace's allocs and frees against `allocator`, `repeat` times, and time them.

    The trace's serials map to the allocations `allocator` hands out; allocations the trace
    leaves live are freed after each pass, untimed, so every pass starts where the first did.

    Args:
        trace: TraceEvents (`TraceAdaptor.events`, `load_trace(...)`) or a JSON-lines path/file.
        allocator: any Allocator.
        repeat: how many passes, >= 1.

    Returns:
        {"events", "allocs", "frees": counts over all passes, "repeat", "seconds": time spent
        in the trace's own allocate/free calls, "us_per_event", "stats": allocator.stats()}.

    Raises:
        ValueError: a bad trace (checked before the allocator is touched) or repeat < 1.
        TypeError: allocator is not an Allocator, or repeat is not an int.
        OutOfMemoryError: from the allocator; what the pass had allocated is freed first.

    Example:
        >>> import allocators
        >>> from allocators.adaptors import TraceAdaptor
        >>> traced = TraceAdaptor(allocators.create("direct", "cpu"))
        >>> traced.free(traced.allocate(64))
        >>> replay(traced.events, allocators.create("direct", "cpu"), repeat=3)["allocs"]
        3
    """
    if not isinstance(trace, (list, tuple)):
        trace = load_trace(trace)
    if not isinstance(allocator, Allocator):
        raise TypeError(f"replay() needs an allocators.Allocator, got {type(allocator).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int):
        raise TypeError(f"repeat must be an int, got {repeat!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for index, event in enumerate(trace):
        if not isinstance(event, TraceEvent):
            raise TypeError(f"trace event {index + 1} is a {type(event).__name__}, "
                            f"not a TraceEvent")
    _check_sequence(trace, lambda index: f"trace event {index + 1}")
    # NOTE: each alloc gets a slot in a list, and its free names that slot: a list index costs
    # less than a dict keyed by serial, and the timed loop does nothing else per event. A slot
    # is reused once freed, so the list drops a freed allocation at the next alloc.
    slot_of: dict[int, int] = {}
    unused: list[int] = []
    steps: list[tuple[bool, int, int]] = []
    slots = 0
    for event in trace:
        if event.action == "alloc":
            if unused:
                slot = unused.pop()
            else:
                slot, slots = slots, slots + 1
            slot_of[event.serial] = slot
            steps.append((True, slot, event.nbytes))
        else:
            slot = slot_of.pop(event.serial)
            unused.append(slot)
            steps.append((False, slot, event.nbytes))
    allocate, free = allocator.allocate, allocator.free
    seconds = 0.0
    for _ in range(repeat):
        live: list[Allocation | None] = [None] * slots
        try:
            start = time.perf_counter()
            for is_alloc, slot, nbytes in steps:
                if is_alloc:
                    live[slot] = allocate(nbytes)
                else:
                    free(live[slot])
            seconds += time.perf_counter() - start
        finally:
            # what this pass left live (by the trace, or by an error part way)
            for allocation in live:
                if allocation is not None and allocation.live:
                    free(allocation)
    allocs = sum(is_alloc for is_alloc, _, _ in steps)
    events = len(steps) * repeat
    return {"events": events, "allocs": allocs * repeat, "frees": (len(steps) - allocs) * repeat,
            "repeat": repeat, "seconds": seconds,
            "us_per_event": seconds * 1e6 / events if events else 0.0,
            "stats": allocator.stats()}
