"""A set of row numbers in one bit a row.

A job records which rows have an answer (the writer, and a resumed job's reader skips
them). A Python set of a million ints holds about 60 MB; a bitmap holds 125 kB, so the
bookkeeping stays small beside the rest of the process however many rows a job has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Set


class RowSet(Set):
    """Non-negative ints, one bit each in a bytearray that grows to the largest one added.
    A `collections.abc.Set`: `in`, len, iteration in ascending order, and comparison and
    set algebra with ordinary sets."""

    __slots__ = ("_bits", "_count")

    def __init__(self, rows: Iterable[int] = ()) -> None:
        self._bits = bytearray()
        self._count = 0
        self.update(rows)

    def add(self, row: int) -> None:
        if row < 0:
            raise ValueError(f"row numbers are >= 0, got {row}")
        byte, bit = row >> 3, 1 << (row & 7)
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))  # doubling
        if not self._bits[byte] & bit:
            self._bits[byte] |= bit
            self._count += 1

    def update(self, rows: Iterable[int]) -> None:
        for row in rows:
            self.add(row)

    def __contains__(self, row: object) -> bool:
        if not isinstance(row, int) or row < 0:
            return False
        byte = row >> 3
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << (row & 7)))

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for byte, value in enumerate(self._bits):
            if value:
                for bit in range(8):
                    if value & (1 << bit):
                        yield (byte << 3) | bit

    def copy(self) -> RowSet:
        other = RowSet()
        other._bits, other._count = bytearray(self._bits), self._count
        return other

    def nbytes(self) -> int:
        """The bitmap's size: a bit for every row up to the largest one added."""
        return len(self._bits)

    def __repr__(self) -> str:
        return f"RowSet({len(self)} rows)"
