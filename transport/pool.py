"""Receive buffers: a byte-budgeted pool of reusable buffers in power-of-two size classes.

Algorithm. ``acquire(n)`` rounds ``n`` up to a size class (a power of two, at least 4 KiB) and pops a
free buffer of that class; if there is none, it allocates one while the pool's allocated bytes stay
within ``capacity``, first evicting free buffers of other classes when that makes room. Buffers are
never freed on release: they go back to their class's free list, so a steady stream of frames
allocates nothing. When the budget is exhausted ``acquire`` returns ``None`` and the caller waits
for a release (``on_release`` callbacks fire on each one): that is the receive-side backpressure.

Invariants: ``in_use_bytes <= allocated_bytes <= capacity`` (one oversized request larger than the
capacity is refused outright); every lease is released at most once; ``leases`` counts leases not yet
released, so tests can assert that a transport returned every buffer.

Failure behaviour: a lease's ``view`` is released with the lease; using it afterwards raises
``ValueError``. Views derived from it (slices, numpy arrays) are not tracked: a holder that keeps data
past release must copy it (``Delivery.detach``).
"""

from __future__ import annotations

from collections.abc import Callable

MIN_CLASS = 4096


def size_class(n: int) -> int:
    """The buffer size that serves a request of ``n`` bytes."""
    return MIN_CLASS if n <= MIN_CLASS else 1 << (n - 1).bit_length()


class Lease:
    """One buffer lent out by a pool: ``view`` covers exactly the requested bytes."""

    __slots__ = ("_pool", "buffer", "nbytes", "view")

    def __init__(self, pool: BufferPool, buffer: bytearray, nbytes: int) -> None:
        self._pool: BufferPool | None = pool
        self.buffer = buffer
        self.nbytes = nbytes
        self.view = memoryview(buffer) if nbytes == len(buffer) else memoryview(buffer)[:nbytes]  # one view, not two

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        self.view.release()
        pool._give_back(self.buffer)

    def discard(self) -> None:
        """Give up the lease without recycling its buffer (something may still write into it)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._forget(self.buffer)


class BufferPool:
    """Reusable receive buffers under a byte budget (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < MIN_CLASS:
            raise ValueError(f"pool capacity must be at least {MIN_CLASS} bytes")
        self.capacity = capacity
        self._free: dict[int, list[bytearray]] = {}
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.leases = 0
        self.allocations = 0
        """How many buffers were ever allocated (constant in steady state)."""
        self.discarded = 0
        """Buffers dropped by ``Lease.discard`` (never reused)."""
        self._listeners: list[Callable[[], None]] = []

    def fits(self, n: int) -> bool:
        """Whether a request of ``n`` bytes can ever be served by this pool."""
        return size_class(n) <= self.capacity

    def acquire(self, n: int) -> Lease | None:
        """A lease of ``n`` bytes, or ``None`` while the budget is exhausted."""
        c = size_class(n)
        if c > self.capacity:
            raise ValueError(f"{n} bytes exceed the pool's capacity of {self.capacity}")
        free = self._free.get(c)
        if free:
            buf = free.pop()
        else:
            if self.allocated_bytes + c > self.capacity and not self._evict(c):
                return None
            buf = bytearray(c)
            self.allocated_bytes += c
            self.allocations += 1
            if free is None:
                self._free[c] = []  # where the buffer goes back to
        self.in_use_bytes += c
        self.leases += 1
        return Lease(self, buf, n)

    def _evict(self, need: int) -> bool:
        """Free idle buffers of other classes until ``need`` more bytes fit; False if they cannot."""
        idle = sum(cls * len(bufs) for cls, bufs in self._free.items() if cls != need)
        if self.allocated_bytes - idle + need > self.capacity:
            return False
        for cls in sorted(self._free, reverse=True):
            if cls == need:
                continue
            bufs = self._free[cls]
            while bufs and self.allocated_bytes + need > self.capacity:
                bufs.pop()
                self.allocated_bytes -= cls
        return self.allocated_bytes + need <= self.capacity

    def _give_back(self, buf: bytearray) -> None:
        c = len(buf)
        self.in_use_bytes -= c
        self.leases -= 1
        self._free[c].append(buf)
        if self._listeners:
            for cb in list(self._listeners):
                cb()

    def _forget(self, buf: bytearray) -> None:
        c = len(buf)
        self.in_use_bytes -= c
        self.leases -= 1
        self.allocated_bytes -= c
        self.discarded += 1
        for cb in list(self._listeners):
            cb()

    def on_release(self, cb: Callable[[], None]) -> Callable[[], None]:
        """Call ``cb`` after every release until the returned function is called."""
        self._listeners.append(cb)

        def remove() -> None:
            if cb in self._listeners:
                self._listeners.remove(cb)

        return remove
