"""Host memory lent by tsd: an arena of blocks over a few large regions.

The pagers need many host buffers of many sizes, made and dropped every step. Each one a tsd
region would cost a daemon round trip and a CUDA registration per buffer; torch's pinned
allocator instead rounds blocks up to powers of two, pins them on first use and keeps them out of
tsd's accounting. `HostArena` takes a few large regions from tsd (`Client.alloc`: charged to the
job's quota, shown by `tsctl`, locked in RAM, CUDA-registered where a GPU is present) and hands
out aligned blocks of them:

* growth: a new region of max(`chunk_bytes`, the request), page-rounded; when the job's quota
  or the pool cannot lend that much, just the request; when not even that, `QuotaExceeded` that
  says for what, how much the arena holds, and what to do.
* placement: best fit over the free ranges of every region; a freed block is merged with its free
  neighbours (coalescing), so a steady training loop reuses the same bytes step after step and
  the arena stops growing after the first step.
* release: `HostBlock.release(after=event)` returns a block once a CUDA event (the last copy
  that reads or writes it) has completed. Releases may come from any thread (autograd's) and
  from finalizers: they are queued and folded in by the next `alloc()` (or `reclaim()`).
* shrinking: the arena keeps its regions between steps (each step reuses them); `trim(keep)`
  frees empty regions back to tsd until `keep` bytes of capacity remain, for when the pages a
  step needs shrink for good (activation_offload="auto" bringing blocks back, or recomputing them).

`PinnedHost` has the same interface over torch's own pinned allocator (or plain memory on a
CPU-only run): what a pager uses when no tsd job lends it memory.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import warnings
from typing import Any, Optional, Protocol

import torch

from .client import Client, Region
from .errors import FailedPrecondition, QuotaExceeded, TsdError
from .units import PAGE_BYTES, format_bytes, round_up

# A new region is at least this large (or the request, whichever is larger).
CHUNK_BYTES = 256 << 20
# Every block starts at a multiple of this (any dtype, and DMA-friendly).
ALIGN_BYTES = 512
_arena_ids = itertools.count()


class HostBlock:
    """`nbytes` of host memory: `data`, a uint8 tensor over them. `view(dtype, size, stride)`
    gives a tensor of any layout that covers exactly `nbytes`. `release(after)` gives the block
    back (after `after`, a CUDA event, has completed); it must not be used afterwards."""

    __slots__ = ("data", "nbytes", "_owner", "_key")

    def __init__(self, data: torch.Tensor, owner: Any, key: Any) -> None:
        self.data, self.nbytes, self._owner, self._key = data, int(data.numel()), owner, key

    def view(self, dtype: torch.dtype, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
        return self.data.view(dtype).as_strided(size, stride)

    def release(self, after: Optional[torch.cuda.Event] = None) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give_back(self._key, after)
        self.data = torch.empty(0, dtype=torch.uint8)  # the block's memory is not ours any more


class HostMemory(Protocol):
    """What a pager allocates its host buffers from."""

    def alloc(self, nbytes: int) -> HostBlock: ...

    def trim(self, keep_bytes: int = 0) -> int: ...


class PinnedHost:
    """Host blocks from torch: pinned (torch's caching host allocator) when `pin`, else plain
    memory. Not charged to any tsd job."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin

    def alloc(self, nbytes: int) -> HostBlock:
        return HostBlock(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None, None)

    def trim(self, keep_bytes: int = 0) -> int:
        """Nothing to give back: torch's caching allocator keeps its own blocks. Returns 0."""
        return 0


class _Chunk:
    """One region of the arena: its byte view and its free ranges, sorted by offset."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.base: Optional[torch.Tensor] = region.view(torch.uint8)
        self.starts: list[int] = [0]          # free ranges: starts[i] .. starts[i] + sizes[i]
        self.sizes: list[int] = [region.size]
        self.used = 0

    def take(self, i: int, n: int) -> int:
        off = self.starts[i]
        if self.sizes[i] == n:
            del self.starts[i], self.sizes[i]
        else:
            self.starts[i] += n
            self.sizes[i] -= n
        self.used += n
        return off

    def give(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, off)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == off:  # merge with the range before
            i -= 1
            self.sizes[i] += n
        else:
            self.starts.insert(i, off)
            self.sizes.insert(i, n)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:  # and after
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]
        self.used -= n


class HostArena:
    """Blocks of host memory from a few large tsd regions of `client`'s job; see the module
    docstring. `purpose` and `advice` go into the error when tsd cannot lend more (e.g.
    "activation paging" and what the user can change). Counters: `capacity_bytes` (the regions),
    `in_use_bytes` (blocks handed out, as of the last alloc or reclaim), `grows` (regions made)."""

    def __init__(self, client: Client, purpose: str = "host buffers", advice: str = "",
                 chunk_bytes: int = CHUNK_BYTES, align: int = ALIGN_BYTES) -> None:
        if align < 1 or align & (align - 1) or PAGE_BYTES % align:
            raise ValueError(f"align must be a power of two dividing the page size {PAGE_BYTES}, not {align}")
        if chunk_bytes < PAGE_BYTES:
            raise ValueError(f"chunk_bytes must be at least one page ({PAGE_BYTES} bytes), not {chunk_bytes}")
        self.client, self.purpose, self.advice = client, purpose, advice
        self.chunk_bytes = round_up(int(chunk_bytes), PAGE_BYTES)
        self.align = align
        self.chunks: list[_Chunk] = []
        self.grows = 0
        self.closed = False
        self._name = f"trainstream/arena-{os.getpid()}-{next(_arena_ids)}"
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[Any, Optional[torch.cuda.Event]]] = collections.deque()
        self._waiting: list[tuple[Any, torch.cuda.Event]] = []  # released, but a copy may still use them

    # ---- counters
    @property
    def capacity_bytes(self) -> int:
        return sum(c.region.size for c in self.chunks)

    @property
    def in_use_bytes(self) -> int:
        return sum(c.used for c in self.chunks)

    @property
    def regions(self) -> list[Region]:
        return [c.region for c in self.chunks]

    # ---- blocks
    def alloc(self, nbytes: int) -> HostBlock:
        """A block of at least `nbytes` (aligned); grows the arena when no free range fits."""
        if self.closed:
            raise FailedPrecondition(f"this arena ({self.purpose}) was closed")
        n = round_up(max(int(nbytes), 1), self.align)
        with self._lock:
            self._reclaim(wait=False)
            hit = self._fit(n)
            if hit is None and self._waiting:
                self._reclaim(wait=True)  # copies still in flight: wait for them rather than grow
                hit = self._fit(n)
            if hit is None:
                self._grow(n)
                hit = self._fit(n)
            assert hit is not None
            chunk, i = hit
            off = chunk.take(i, n)
        assert chunk.base is not None
        return HostBlock(chunk.base.narrow(0, off, int(nbytes)), self, (chunk, off, n))

    def reclaim(self) -> None:
        """Folds in every released block whose copies have completed (waits for none)."""
        with self._lock:
            self._reclaim(wait=False)

    def trim(self, keep_bytes: int = 0) -> int:
        """Frees empty regions back to tsd (their quota with them), largest kept first, until
        `keep_bytes` of capacity remain; waits for the copies of released blocks first. A region
        with a block in use stays. Returns the bytes freed; an error from tsd is raised with the
        arena whole (the regions freed before it gone, the rest usable)."""
        freed = 0
        with self._lock:
            self._reclaim(wait=True)
            room = sum(c.region.size for c in self.chunks if c.used)
            for c in sorted(self.chunks, key=lambda c: -c.region.size):
                if c.used:
                    continue  # counted in `room` already
                if room < keep_bytes:
                    room += c.region.size
                    continue
                c.base = None  # the arena's own view of it
                try:
                    self.client.free(c.region)
                except BaseException as e:
                    c.base = c.region.view(torch.uint8)  # it stays: a view of it is alive, or tsd failed
                    if not isinstance(e, FailedPrecondition):
                        raise
                    room += c.region.size
                    continue
                self.chunks.remove(c)  # as it goes: an error on a later region leaves the arena whole
                freed += c.region.size
        return freed

    def close(self) -> None:
        """Frees every region back to tsd. A region with blocks still alive (e.g. a graph kept
        past unwrap()) stays mapped and is released with the job."""
        with self._lock:
            self._reclaim(wait=True)
            self.closed = True
            kept = []
            for c in self.chunks:
                c.base = None
                try:
                    self.client.free(c.region)
                except FailedPrecondition:
                    kept.append(c)  # live views: the memory is still in use
                except TsdError:
                    pass  # the daemon is gone, or the job was released: the region is gone with it
            if kept:
                warnings.warn(f"trainstream: {len(kept)} region(s) of the {self.purpose} arena still have blocks in "
                              f"use; they are released with the job")
            self.chunks = kept

    def _give_back(self, key: Any, after: Optional[torch.cuda.Event]) -> None:
        self._returned.append((key, after))  # thread-safe; folded in under the lock later

    def _reclaim(self, wait: bool) -> None:
        while self._returned:
            key, event = self._returned.popleft()
            if event is None:
                self._free(key)
            else:
                self._waiting.append((key, event))
        still = []
        for key, event in self._waiting:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._free(key)
            else:
                still.append((key, event))
        self._waiting = still

    def _free(self, key: Any) -> None:
        chunk, off, n = key
        if chunk in self.chunks:
            chunk.give(off, n)

    def _fit(self, n: int) -> Optional[tuple[_Chunk, int]]:
        best: Optional[tuple[_Chunk, int]] = None
        best_size = 0
        for c in self.chunks:
            for i, size in enumerate(c.sizes):
                if size >= n and (best is None or size < best_size):
                    best, best_size = (c, i), size
                    if size == n:
                        return best
        return best

    def _grow(self, n: int) -> None:
        sizes = [max(self.chunk_bytes, round_up(n, PAGE_BYTES))]
        if sizes[0] > round_up(n, PAGE_BYTES):
            sizes.append(round_up(n, PAGE_BYTES))  # a tight quota may still lend just the request
        for i, size in enumerate(sizes):
            try:
                region = self.client.alloc(f"{self._name}/{self.grows}", size)
                break
            except QuotaExceeded as e:
                if i + 1 < len(sizes):
                    continue
                raise QuotaExceeded(
                    f"tsd cannot lend {format_bytes(round_up(n, PAGE_BYTES))} more for {self.purpose} to job "
                    f"{self.client.job!r} (quota {format_bytes(self.client.quota_bytes)}; this arena holds "
                    f"{format_bytes(self.capacity_bytes)} in {len(self.chunks)} region(s), "
                    f"{format_bytes(self.in_use_bytes)} in use): {e.message}. {self.advice}".rstrip(),
                    e.code) from e
        self.chunks.append(_Chunk(region))
        self.grows += 1

    def __repr__(self) -> str:
        return (f"<trainstream.HostArena {self.purpose}: {format_bytes(self.capacity_bytes)} in {len(self.chunks)} "
                f"region(s), {format_bytes(self.in_use_bytes)} in use>")
