"""Immutable constants: read-only tensors whose equal contents share one block (DL4J's
immutable buffers).

`constant(data)` hashes the raw bytes of `data` and looks them up in a `ConstantPool`. On a hit
the stored block is read back and compared byte for byte before it is shared, so a hash collision
can never hand out the wrong data; on a miss a new block is filled and marked read-only. Only the
bytes are shared: each returned tensor carries its own dtype and shape over the block. Every
write to a constant (`out=`, through a view, by copy) raises `ReadOnlyError`. The pool holds no
reference of its own: the block's memory goes back when its last tensor goes, and the pool
forgets it then.

Where constants live: a pool made without an allocator keeps them in its device's read-only
memory through a `ReadOnlyAllocator` of its own: `READ_ONLY` buffers on OpenCL, non-writeable
ndarrays on the CPU, so the device itself refuses kernel writes where it can (CUDA cannot: there
they are ordinary memory, see `backends.cuda`). A pool given an allocator uses that allocator's
memory, which is ordinary; `ReadOnlyError` guards constants everywhere either way.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

import backends
from allocators import Allocator, DirectAllocator, format_bytes
from runtime import config
from runtime._tensor import Tensor, check_device_of, host_array
from runtime.block import Block
from runtime.errors import device_names

if TYPE_CHECKING:
    from backends import Device

__all__ = ["ConstantPool", "ReadOnlyAllocator", "constant", "content_digest"]

#: (nbytes, digest of the bytes)
Key = tuple[int, bytes]


def content_digest(data: np.ndarray) -> bytes:
    """The BLAKE2b digest (16 bytes) of the raw bytes of a C-contiguous uint8 array."""
    return hashlib.blake2b(data, digest_size=16).digest()


class ReadOnlyAllocator(DirectAllocator):
    """A direct allocator over its device's read-only memory (`Device.raw_alloc(n,
    read_only=True)`): each allocation is its own read-only buffer, and goes back to the device
    when freed. Kernels may only read what it hands out; the host fills it with `copyin`. It is
    where a `ConstantPool` made without an allocator keeps its constants, and suits nothing else:
    an ordinary tensor in this memory could not be written by any kernel.

    Example:
        >>> alloc = ReadOnlyAllocator("cpu")
        >>> a = alloc.allocate(64)
        >>> alloc.device.is_read_only(a.raw)
        True
        >>> alloc.free(a)
    """

    name = "read-only"
    #: `Allocator._device_alloc` then asks the device for read-only memory
    read_only_memory = True


class ConstantPool:
    """Deduplicated, read-only blocks on one allocator, keyed by (nbytes, content digest).

    A digest hit is verified by reading the block back; a mismatch is counted as a collision and
    the data gets a block of its own (several blocks may then share a key). A block stays in the
    pool exactly as long as its memory lives: when the last tensor over it is released, or
    `Block.free()` is called, the memory goes back to the allocator and the pool forgets it.

    Args:
        allocator: where the blocks' memory comes from. None (the default): a new
            `ReadOnlyAllocator` on `device`, so the constants sit in read-only device memory.
        device: the device of a pool made without an allocator (default: the default device);
            given with an allocator, it must be the allocator's.

    Raises:
        TypeError: `allocator` is not an allocators.Allocator.
        ValueError: `device` is not the allocator's device.

    Example:
        >>> import numpy as np, allocators
        >>> pool = ConstantPool(allocators.create("direct"))
        >>> a = pool.constant(np.arange(4.0))
        >>> b = pool.constant(np.arange(4.0).reshape(2, 2))
        >>> a.block is b.block, pool.stats()["hits"]
        (True, 1)
        >>> ConstantPool(device="cpu").allocator
        <ReadOnlyAllocator on cpu>
    """

    def __init__(self, allocator: Allocator | None = None, *, device: Any = None) -> None:
        if allocator is None:
            dev = backends.get_device(device) if device is not None else \
                config.get_default_device()
            allocator = ReadOnlyAllocator(dev)
        elif not isinstance(allocator, Allocator):
            raise TypeError(f"ConstantPool takes an allocators.Allocator, "
                            f"got {type(allocator).__name__}")
        else:
            check_device_of(allocator, device)
        self.allocator = allocator
        self.device = allocator.device
        #: key -> its blocks: a list, because verified collisions get blocks of their own
        self._entries: dict[Key, list[Block]] = {}
        #: block id -> its key, to forget it in O(1)
        self._keys: dict[int, Key] = {}
        self._bytes = 0
        self._counters = dict.fromkeys(("lookups", "hits", "misses", "collisions"), 0)
        # NOTE: re-entrant because a release during a lookup (garbage collection of another
        # constant's last tensor) calls back into _forget on the same thread.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public policy
    def constant(self, data: Any, dtype: Any = None) -> Tensor:
        """A read-only tensor holding `data`, sharing a block with any equal bytes in the pool.

        Raises:
            TypeError: the data or dtype cannot be held by a tensor.
        """
        host = host_array(data, dtype, "constant")
        raw = host.reshape(-1).view(np.uint8)
        key = (raw.nbytes, content_digest(raw))
        with self._lock:
            self._counters["lookups"] += 1
            for block in list(self._entries.get(key, ())):
                shared = self._share(block, host, raw)
                if shared is not None:
                    self._counters["hits"] += 1
                    return shared
            self._counters["misses"] += 1
            return self._add(key, host)

    def stats(self) -> dict[str, int | float]:
        """constants (live blocks), bytes (their size), lookups, hits, misses,
        hit_rate = hits / lookups, and collisions (digest matches whose bytes differed)."""
        with self._lock:
            snapshot: dict[str, int | float] = dict(self._counters)
            snapshot["constants"] = len(self._keys)
            snapshot["bytes"] = self._bytes
        lookups = snapshot["lookups"]
        snapshot["hit_rate"] = snapshot["hits"] / lookups if lookups else 0.0
        return snapshot

    def blocks(self) -> list[Block]:
        """The live constant blocks, oldest first."""
        with self._lock:
            return [block for bucket in self._entries.values() for block in bucket]

    def check_invariants(self) -> None:
        """Raise AssertionError unless every entry is a live, read-only, written block of this
        allocator filed under the digest of its current bytes, in read-only device memory when
        the allocator is a ReadOnlyAllocator on a device that has it, and the counters add up."""
        with self._lock:
            entries = {key: list(bucket) for key, bucket in self._entries.items()}
            keys = dict(self._keys)
            nbytes = self._bytes
            c = dict(self._counters)
        blocks = [block for bucket in entries.values() for block in bucket]
        read_only_memory = (isinstance(self.allocator, ReadOnlyAllocator)
                            and self.device.capabilities.read_only_memory)
        if not (len(blocks) == len(keys) == len({b.id for b in blocks})):
            raise AssertionError("entries and keys drifted")
        if not (all(entries.values())):
            raise AssertionError("an empty bucket was left behind")
        if not (nbytes == sum(b.nbytes for b in blocks)):
            raise AssertionError("bytes drifted")
        if not (c["hits"] + c["misses"] == c["lookups"]):
            raise AssertionError("hits + misses != lookups")
        for key, bucket in entries.items():
            for block in bucket:
                if not (keys[block.id] == key):
                    raise AssertionError(f"block #{block.id} is filed under two keys")
                if not (block.readonly and block.written):
                    raise AssertionError(f"block #{block.id} is writable or empty")
                if not (block.refcount > 0):
                    raise AssertionError(f"block #{block.id} has no user but is still pooled")
                if block.allocator is not self.allocator:
                    raise AssertionError(f"block #{block.id} has another owner")
                if not (block.on_return == self._forget):
                    raise AssertionError(f"block #{block.id} lost its hook")
                if not ((block.nbytes, content_digest(self._read(block))) == key):
                    raise AssertionError(f"block #{block.id} no longer holds the bytes of its key")
                if read_only_memory:
                    raw = block.memory_for_read("constant pool check").raw
                    if not (self.device.is_read_only(raw)):
                        raise AssertionError(f"block #{block.id} is not in read-only memory")

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<ConstantPool on {self.device.name}: {s['constants']} constants, "
                f"{format_bytes(int(s['bytes']))}, hit rate {s['hit_rate']:.0%}>")

    # ------------------------------------------------------------------ mechanism
    def _read(self, block: Block) -> np.ndarray:
        allocation = block.memory_for_read("constant pool verification")
        return self.device.copyout(allocation.raw, allocation.offset, block.nbytes)

    def _share(self, block: Block, host: np.ndarray, raw: np.ndarray) -> Tensor | None:
        """A new tensor over `block` if it holds exactly `raw`, else None (a collision)."""
        # NOTE: take the reference before reading, so the block cannot go away meanwhile.
        handle = Tensor(block, host.shape, host.dtype)
        if block.written and np.array_equal(self._read(block), raw):
            return handle
        if block.written:
            self._counters["collisions"] += 1
        handle.release()
        return None

    def _add(self, key: Key, host: np.ndarray) -> Tensor:
        """A new read-only block holding `host`, filed under `key`."""
        handle = Tensor(Block(host.nbytes, self.allocator), host.shape, host.dtype)
        block = handle.block
        allocation = block.memory_for_write("runtime.constant")
        self.device.copyin(allocation.raw, allocation.offset, host)
        block.mark_written()
        block.readonly = True
        # NOTE: the hook rather than weak references: a Block object outlives its memory (a
        # released tensor still points at it, and Block.free() keeps it alive), so what must
        # end the entry is the memory going back, which only the block itself sees.
        block.on_return = self._forget
        block.lock = self._lock  # NOTE: a lookup never shares a block whose last release runs
        self._entries.setdefault(key, []).append(block)
        self._keys[block.id] = key
        self._bytes += block.nbytes
        return handle

    def _forget(self, block: Block) -> None:
        """Block.on_return hook: the block's memory went back, so drop its entry."""
        with self._lock:
            key = self._keys.pop(block.id, None)
            if key is None:
                return
            bucket = self._entries[key]
            bucket.remove(block)
            if not bucket:
                del self._entries[key]
            self._bytes -= block.nbytes


def constant(data: Any, dtype: Any = None, device: Any = None,
             pool: ConstantPool | None = None) -> Tensor:
    """A read-only tensor holding a copy of `data`; equal bytes share one block.

    `pool` defaults to the device's default constant pool (`device` defaults to the pool's, or
    cpu). Reading works as for any tensor; every write raises `runtime.ReadOnlyError`. The block
    is freed when its last tensor is released.

    Raises:
        TypeError: the data or dtype cannot be held by a tensor, or `pool` is not a ConstantPool.
        ValueError: `pool` lives on another device than `device`.

    Example:
        >>> import numpy as np, runtime
        >>> a = runtime.constant(np.arange(4.0))
        >>> runtime.constant(np.arange(4.0)).block is a.block
        True
    """
    if pool is None:
        pool = get_default_constant_pool(device)
    elif not isinstance(pool, ConstantPool):
        raise TypeError(f"pool must be a runtime.ConstantPool, got {type(pool).__name__}")
    elif device is not None and backends.get_device(device) is not pool.device:
        have, asked = device_names(pool.device, backends.get_device(device))
        raise ValueError(f"the pool is on {have}, but device {asked} was asked for")
    return pool.constant(data, dtype)


# ---------------------------------------------------------------------- per-device default pools
#: The device attribute that holds its default pool (see runtime.config.per_device).
_POOL = "_blockrt_default_constant_pool"


def get_default_constant_pool(device: str | Device | None = None) -> ConstantPool:
    """The constant pool `runtime.constant` uses on `device` (default: the default device),
    created on first use over a `ReadOnlyAllocator` of its own: constants live in the device's
    read-only memory."""
    dev = config.device_or_default(device)
    pool = dev.__dict__.get(_POOL)
    if pool is None:
        pool = config.per_device(_POOL, dev, lambda: ConstantPool(device=dev))
    return pool


def default_constant_pools() -> dict[Device, ConstantPool]:
    """Device -> default constant pool, for every living device that has one so far."""
    return config.devices_with(_POOL)
