"""Reports: `memory_summary()` (every allocator's and constant pool's stats as a fixed-width text
table), `format_report` (a graph's memory report) and `plot_memory_timeline` (a PNG)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from allocators import Allocator, format_bytes
from allocators.base import live_allocators
from runtime import config
from runtime.constant import ConstantPool, default_constant_pools

__all__ = ["format_report", "memory_summary", "plot_memory_timeline"]

#: (header, stats key, how to show it) for each column of the allocator table.
_ALLOCATOR_COLUMNS = (
    ("allocated", "allocated_bytes", "bytes"),
    ("peak allocated", "peak_allocated_bytes", "bytes"),
    ("reserved", "reserved_bytes", "bytes"),
    ("cached", "cached_bytes", "bytes"),
    ("requested", "requested_bytes", "bytes"),
    ("allocs", "num_allocs", "count"),
    ("frees", "num_frees", "count"),
    ("hit rate", "hit_rate", "ratio"),
    ("fragmentation", "fragmentation", "ratio"),
    ("OOMs", "num_ooms", "count"),
)
#: The same for the constant pool table.
_POOL_COLUMNS = (
    ("constants", "constants", "count"),
    ("bytes", "bytes", "bytes"),
    ("lookups", "lookups", "count"),
    ("hits", "hits", "count"),
    ("misses", "misses", "count"),
    ("hit rate", "hit_rate", "ratio"),
    ("collisions", "collisions", "count"),
)
#: Between cells: cells never hold two spaces in a row, so a row splits on this gap.
_GAP = "  "


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return format_bytes(int(value))
    if kind == "ratio":
        return f"{100 * value:.1f}%"
    return str(int(value))


def _table(title: str, columns: Sequence[tuple[str, str, str]],
           rows: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """Lines of one table: a header, a rule and a row per (label, stats); numbers right-aligned."""
    header = [title] + [name for name, _, _ in columns]
    body = [[label] + [_cell(stats.get(key), kind) for _, key, kind in columns]
            for label, stats in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:]))
        return _GAP.join([first, *rest]).rstrip()

    return [render(header), "-" * len(render(header)), *(render(cells) for cells in body)]


def _label(obj: Allocator | ConstantPool) -> str:
    """Device and type, e.g. `cpu CachingAllocator`; an adaptor stack shows every layer, e.g.
    `cpu StatisticsAdaptor(CachingAllocator)`."""
    names, inner = [], obj
    while inner is not None:
        names.append(type(inner).__name__)
        inner = getattr(inner, "upstream", None)
    return f"{obj.device.name} {'('.join(names)}{')' * (len(names) - 1)}"


def _collect(objects: Any) -> tuple[list[tuple[str, Allocator]], list[tuple[str, ConstantPool]]]:
    """Split an explicit list or {label: object} mapping into labelled allocators and pools."""
    if isinstance(objects, (Allocator, ConstantPool)):
        objects = [objects]
    if isinstance(objects, Mapping):
        items: Iterable[tuple[Any, Any]] = objects.items()
    elif isinstance(objects, Iterable) and not isinstance(objects, (str, bytes)):
        items = ((None, obj) for obj in objects)
    else:
        raise TypeError(f"memory_summary takes a list or dict of allocators, "
                        f"got {type(objects).__name__}")
    found_allocators, found_pools = [], []
    for label, obj in items:
        if isinstance(obj, Allocator):
            found_allocators.append((str(label) if label is not None else _label(obj), obj))
        elif isinstance(obj, ConstantPool):
            found_pools.append((str(label) if label is not None else _label(obj), obj))
        else:
            raise TypeError(f"memory_summary: {obj!r} is neither an allocators.Allocator nor a "
                            f"runtime.ConstantPool")
    return found_allocators, found_pools


def _live() -> tuple[list[tuple[str, Allocator]], list[tuple[str, ConstantPool]]]:
    """Every live allocator, in the order made, and every device's default constant pool.

    An allocator that another live one wraps (its `upstream`) shows in that one's label, not
    on a row of its own, unless it is a device's default or a pool's. Labels say which is a
    device's default (`(default)`) and which holds a default pool's constants
    (`(constants)`); labels that would be equal are numbered in the order made (`#2`, ...).
    """
    defaults = {id(a) for a in config.default_allocators().values()}
    pools = [(_label(p), p) for p in default_constant_pools().values()]
    holders = {id(pool.allocator) for _, pool in pools}
    live = live_allocators()
    wrapped = {id(a.upstream) for a in live if getattr(a, "upstream", None) is not None}
    found = []
    for allocator in live:
        key = id(allocator)
        if key in wrapped and key not in defaults and key not in holders:
            continue
        mark = " (default)" if key in defaults else " (constants)" if key in holders else ""
        found.append((_label(allocator) + mark, allocator))
    counts = Counter(label for label, _ in found)
    seen: Counter[str] = Counter()
    numbered = []
    for label, allocator in found:
        seen[label] += 1
        numbered.append((f"{label} #{seen[label]}" if counts[label] > 1 else label, allocator))
    return numbered, pools


def memory_summary(allocators: Any = None) -> str:
    """A readable fixed-width table of allocator stats, one row per allocator.

    By default: every allocator alive in this process, in the order made, whoever made it (a
    device's default marked `(default)`, the one holding a default constant pool's constants
    `(constants)`; an adaptor stack on one row, labelled with every layer), and a second table
    of the default constant pools. `allocators` may instead be a list of
    Allocators (and ConstantPools), or a dict {row label: allocator or pool}. Byte columns are in
    readable units (allocators.format_bytes); rates are percentages.

    Raises:
        TypeError: something given is neither an Allocator nor a ConstantPool.

    Example:
        >>> import allocators, runtime
        >>> alloc = allocators.create("direct")
        >>> a = alloc.allocate(3 * 1024)
        >>> "3.00 KiB" in runtime.memory_summary({"mine": alloc})
        True
    """
    found, pools = _live() if allocators is None else _collect(allocators)
    lines = ["blockrt memory summary", ""]
    if found or not pools:
        rows = [(label, a.stats()) for label, a in found]
        lines += _table("allocator", _ALLOCATOR_COLUMNS, rows) if rows else ["(no allocators)"]
    if pools:
        if found:
            lines.append("")
        lines += _table("constant pool", _POOL_COLUMNS, [(label, p.stats()) for label, p in pools])
    return "\n".join(lines)


def plot_memory_timeline(timelines: Mapping[str, Sequence[int]], path: str,
                         title: str = "bytes held by intermediates") -> str:
    """Write a PNG with one line per plan: the bytes its intermediates hold at each scheduled
    step (`Graph.timeline()`). Needs matplotlib (the `plot` extra). Returns `path`.

    The y axis starts at 0, in B, KiB or MiB after the largest value; the legend gives each
    line's peak. Lines are drawn widest first, each in its own colour, so a line that lies on
    another one stays visible around it.

    Example:
        >>> plot_memory_timeline({"recycle": [64, 128, 64]}, "/tmp/t.png")  # doctest: +SKIP
        '/tmp/t.png'
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_memory_timeline needs matplotlib: pip install "
                          "'blockrt[plot]'") from exc
    figure = _timeline_figure(plt, timelines, title)
    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return path


def _timeline_figure(plt: Any, timelines: Mapping[str, Sequence[int]], title: str) -> Any:
    """The matplotlib figure `plot_memory_timeline` saves."""
    if not timelines:
        raise ValueError("plot_memory_timeline needs at least one timeline")
    for name, line in timelines.items():
        if len(line) == 0 or min(line) < 0:
            raise ValueError(f"plot_memory_timeline: the timeline {name!r} must hold at least one "
                             f"byte count, none negative; got {list(line)[:8]!r}")
    top = max(max(line) for line in timelines.values())
    unit, scale = next((u, s) for u, s in (("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if top >= s or s == 1)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    widest = 1.5 + 2.0 * (len(timelines) - 1)
    for i, (name, line) in enumerate(timelines.items()):
        steps = range(len(line) + 1)  # NOTE: the last step is drawn as wide as the others
        values = [b / scale for b in line] + [line[-1] / scale]
        axes.step(steps, values, where="post", color=f"C{i}", linewidth=widest - 2.0 * i,
                  alpha=0.9, label=f"{name}: peak {format_bytes(max(line))}")
    axes.set_ylim(0, top / scale * 1.12 or 1)
    axes.set_xlim(0, max(len(line) for line in timelines.values()))
    axes.set_xlabel("scheduled step")
    axes.set_ylabel(f"{unit} held by intermediates")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best")
    figure.tight_layout()
    return figure


def format_report(report: Mapping[str, Any]) -> str:
    """A graph's `memory_report()` as aligned `key: value` lines, bytes in readable units."""
    width = max(len(key) for key in report)
    lines = []
    for key, value in report.items():
        shown = format_bytes(value) if key.endswith("_bytes") else value
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)
