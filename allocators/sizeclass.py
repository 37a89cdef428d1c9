"""Size classes: how a caching allocator rounds a request up to the block size it sets aside.

A size class policy maps a request of `nbytes` to a block size (`round`), numbers the block sizes
it can give with consecutive bins (`bin`, and its inverse `bin_size`), and says which pool a
request belongs to (`pool`: "small" or "large", split at `small_size` as PyTorch does). Every
block size is a positive multiple of `granule` (512 bytes by default), so blocks cut one after
another out of a segment all start at multiples of the granule, and stay aligned for any device
whose alignment divides it.

Three policies ship, named in `SIZE_CLASSES`:

- "granule":  the next multiple of 512 bytes (PyTorch's rounding). Waste < 512 bytes.
- "pow2":     the next power of two, at least 512 bytes. Waste < nbytes (for nbytes > 256).
- "mantissa": floats with 4 mantissa bits, as pyopencl's memory pool bins them: above 8 KiB the
  block size is (16 + m) * 2**e for m in 0..15, so waste < nbytes / 16 (6.25%); up to 8 KiB,
  the next multiple of 512 bytes.

A request of 0 bytes gets the smallest block, one granule: a real, distinct address.

Example:
    >>> from allocators.sizeclass import get_size_class
    >>> mantissa = get_size_class("mantissa")
    >>> mantissa.round(100_000), mantissa.bin(100_000), mantissa.pool(100_000)
    (102400, 72, 'small')
    >>> mantissa.bin_size(72)
    102400
"""

from __future__ import annotations

__all__ = ["SIZE_CLASSES", "GranuleSizeClass", "MantissaSizeClass", "Pow2SizeClass",
           "SizeClass", "get_size_class"]

#: Requests whose block is at most this many bytes are "small" (PyTorch's kSmallSize).
SMALL_SIZE = 1 << 20


def _check_power_of_two(value: int, what: str) -> int:
    if type(value) is not int or value < 1 or value & (value - 1):
        raise ValueError(f"{what} must be a positive power of two, got {value!r}")
    return value


class SizeClass:
    """A size class policy. Subclasses implement `round`, `bin` and `bin_size`.

    Contract (tests check it for every policy): `round(n) >= n`; `round(n)` is a positive multiple
    of `granule`; bins are consecutive ints from 0 and `bin_size` is strictly increasing;
    `round(n) == bin_size(bin(n))` and `bin_size(bin(n) - 1) < n`, i.e. `round(n)` is the
    smallest block size of the policy that holds `n` bytes.

    Attributes:
        name: the policy's name in `SIZE_CLASSES`.
        granule: every block size is a multiple of this power of two.
        small_size: blocks of at most this many bytes belong to the "small" pool.
    """

    name = "size class"

    def __init__(self, granule: int = 512, small_size: int = SMALL_SIZE) -> None:
        self.granule = _check_power_of_two(granule, "granule")
        if type(small_size) is not int or small_size < granule:
            raise ValueError(f"small_size must be an int >= granule ({granule}), "
                             f"got {small_size!r}")
        self.small_size = small_size

    def round(self, nbytes: int) -> int:
        """The block size set aside for a request of `nbytes` bytes (>= nbytes, > 0)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement round()")

    def bin(self, nbytes: int) -> int:
        """The bin number of a request of `nbytes` bytes; bins are consecutive from 0."""
        raise NotImplementedError(f"{type(self).__name__} does not implement bin()")

    def bin_size(self, bin_number: int) -> int:
        """The block size of bin `bin_number`: the inverse of `bin`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement bin_size()")

    def pool(self, nbytes: int) -> str:
        """"small" when the block for `nbytes` is at most `small_size` bytes, else "large"."""
        return "small" if self.round(nbytes) <= self.small_size else "large"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} granule={self.granule}>"


class GranuleSizeClass(SizeClass):
    """The next multiple of the granule (512 bytes): waste < one granule. ("granule")"""

    name = "granule"

    def round(self, nbytes: int) -> int:
        granule = self.granule
        return -(-nbytes // granule) * granule or granule

    def bin(self, nbytes: int) -> int:
        return max(-(-nbytes // self.granule) - 1, 0)

    def bin_size(self, bin_number: int) -> int:
        return (bin_number + 1) * self.granule


class Pow2SizeClass(SizeClass):
    """The next power of two, at least one granule: waste < nbytes above half a granule. ("pow2")"""

    name = "pow2"

    def round(self, nbytes: int) -> int:
        size = 1 << (nbytes - 1).bit_length() if nbytes > 1 else 1
        return size if size > self.granule else self.granule

    def bin(self, nbytes: int) -> int:
        return self.round(nbytes).bit_length() - self.granule.bit_length()

    def bin_size(self, bin_number: int) -> int:
        return self.granule << bin_number


class MantissaSizeClass(SizeClass):
    """Floating-point bins with `mantissa_bits` bits after the leading one. ("mantissa")

    With M = 2**mantissa_bits, sizes up to `granule * M` (8 KiB by default) round to the next
    granule (bins 0 .. M-1). Above that, a request n in (2**(k-1), 2**k] rounds up to a multiple
    of its step 2**(k-1-mantissa_bits), so the block is (M + 1 .. 2M) steps and the waste is
    below one step: `round(n) - n < n / M` (n / 16, 6.25%, for the default 4 bits). The step is
    at least one granule there, so every block stays a multiple of the granule.
    """

    name = "mantissa"

    def __init__(self, granule: int = 512, small_size: int = SMALL_SIZE,
                 mantissa_bits: int = 4) -> None:
        super().__init__(granule, small_size)
        if type(mantissa_bits) is not int or not 0 <= mantissa_bits <= 16:
            raise ValueError(f"mantissa_bits must be an int in [0, 16], got {mantissa_bits!r}")
        self.mantissa_bits = mantissa_bits
        #: sizes up to this round to plain granules
        self.linear_limit = granule << mantissa_bits
        #: the exponent of the first step above linear_limit, which is one granule
        self._first_shift = granule.bit_length() - 1

    def _shift(self, nbytes: int) -> int:
        """log2 of the step for n > linear_limit: n in (2**(k-1), 2**k] has step 2**(k-1-bits)."""
        return (nbytes - 1).bit_length() - 1 - self.mantissa_bits

    def round(self, nbytes: int) -> int:
        if nbytes <= self.linear_limit:
            granule = self.granule
            return -(-nbytes // granule) * granule or granule
        shift = self._shift(nbytes)
        return -(-nbytes >> shift) << shift

    def bin(self, nbytes: int) -> int:
        if nbytes <= self.linear_limit:
            return max(-(-nbytes // self.granule) - 1, 0)
        shift = self._shift(nbytes)
        steps = -(-nbytes >> shift)  # in (M, 2M]
        per_octave = 1 << self.mantissa_bits
        return per_octave * (shift - self._first_shift + 1) + steps - per_octave - 1

    def bin_size(self, bin_number: int) -> int:
        per_octave = 1 << self.mantissa_bits
        if bin_number < per_octave:
            return (bin_number + 1) * self.granule
        shift = bin_number // per_octave + self._first_shift - 1
        steps = bin_number % per_octave + per_octave + 1
        return steps << shift


#: The policies `CachingAllocator(size_classes=name)` accepts, by name.
SIZE_CLASSES: dict[str, type[SizeClass]] = {
    "granule": GranuleSizeClass,
    "pow2": Pow2SizeClass,
    "mantissa": MantissaSizeClass,
}


def get_size_class(spec: str | SizeClass) -> SizeClass:
    """A SizeClass from a name in `SIZE_CLASSES` (built with defaults) or an instance (as is).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither a name nor a SizeClass.
    """
    if isinstance(spec, SizeClass):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"size_classes must be a name or a SizeClass, got {type(spec).__name__}")
    if spec not in SIZE_CLASSES:
        raise ValueError(f"unknown size classes {spec!r}; known: {', '.join(SIZE_CLASSES)}")
    return SIZE_CLASSES[spec]()
