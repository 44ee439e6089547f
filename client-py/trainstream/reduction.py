"""How a data-parallel step's gradients cross the group into tsd (distributed.py's reducers).

Two ways, chosen once per group by `distributed.DataParallel.finish_wrap` (every rank the same):

* `StreamedReduction`, where the group's backend can reduce the gradients on the device that holds
  them (NCCL for CUDA gradients; gloo for CPU ones): bucket by bucket, in one order every rank
  follows, each bucket's reduction starts as soon as this rank's last gradient of the step for it
  is in, while backward goes on, and the owner delivers the sum to tsd as soon as it is there. On
  CUDA every piece of that is queued on streams (NCCL's, then the session's side stream for the
  owner's division, copy into the pinned slot and doorbell), so the host never waits on it during
  backward; on the CPU the owner delivers the reductions that finished whenever a gradient hook
  runs, and the rest at `step()`.
* `HostChunks` otherwise (CUDA gradients and a group without NCCL, e.g. several ranks on one GPU
  over gloo): at `step()`, the gradients go through one host buffer in chunks of about
  `REDUCE_CHUNK_BYTES`, so a rank's host memory for the reduction is one chunk, not its share of
  the model.

Both give tsd the same sums (the gradient in the slot's dtype, summed over the node, then over the
nodes' owners, divided by the world size) and deliver nothing for a bucket that got no gradient on
any rank, so results do not depend on which runs.
"""
from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, Optional

import torch

from .engine import too_many_gradients
from .prefetch import stale_use_event

# HostChunks: the gradients of a step cross the group in chunks of about this many bytes.
REDUCE_CHUNK_BYTES = 64 << 20

# What each backend reduces when a group names one backend for every device.
_BACKEND_DEVICES = {"nccl": ("cuda",), "gloo": ("cpu",), "mpi": ("cpu",)}


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def backend_for(group: Any, device_type: str) -> Optional[str]:
    """The backend `group` runs collectives of `device_type` tensors with (e.g. "nccl" for "cuda"
    in a group made with "cpu:gloo,cuda:nccl"), or None if it has none for that device."""
    spec = str(_dist().get_backend(group)).lower()
    if ":" in spec:
        for part in spec.split(","):
            dev, _, name = part.partition(":")
            if dev.strip() == device_type:
                return name.strip()
        return None
    return spec if device_type in _BACKEND_DEVICES.get(spec, ()) else None


class HostChunks:
    """Reduces a step's gradients at `step()` through one host buffer per dtype, chunk by chunk
    (the node's sum onto the bucket's owner, then the owners of every node all-reduce), over the
    group's gloo groups. The buffers are kept for the next step."""

    streams = False  # nothing happens during backward

    def __init__(self, dp: Any) -> None:
        self.dp = dp
        self.chunk_bytes = REDUCE_CHUNK_BYTES
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self.taken: set[int] = set()  # never: the gradients stay in p.grad until step()

    hyper = None  # nothing is launched before step()

    def on_grad(self, session: Any, optimizer: torch.optim.Optimizer, ps: Any) -> None:
        """Backward's hook: the gradient stays in p.grad (accumulating) until step()."""

    def end_step(self) -> None:
        """Nothing is kept between steps but the buffers."""

    def finish(self, session: Any, stepped: list[int]) -> None:
        """Reduces and delivers every bucket of `stepped`, owner by owner and dtype by dtype."""
        params = session.params
        for owner in range(self.dp.local_world):
            by_dtype: dict[torch.dtype, list[int]] = {}
            for b in stepped:
                if self.dp.owner[b] == owner:
                    by_dtype.setdefault(params[b].grad_slot.dtype, []).append(b)
            for dtype, buckets in by_dtype.items():
                self._reduce(session, buckets, dtype, owner)

    def _reduce(self, session: Any, buckets: list[int], dtype: torch.dtype, owner: int) -> None:
        params = session.params
        limit = max(1, self.chunk_bytes // dtype.itemsize)
        chunk: list[int] = []
        size = 0
        for b in buckets:
            n = params[b].shape.numel()
            if chunk and size + n > limit:
                self._reduce_chunk(session, chunk, dtype, owner, size)
                chunk, size = [], 0
            chunk.append(b)
            size += n
        if chunk:
            self._reduce_chunk(session, chunk, dtype, owner, size)

    def _staging(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[dtype] = buf
        return buf[:numel]

    def _reduce_chunk(self, session: Any, buckets: list[int], dtype: torch.dtype, owner: int, numel: int) -> None:
        dist, dp = _dist(), self.dp
        params = session.params
        flat = self._staging(dtype, numel)
        offset = 0
        for ps in (params[b] for b in buckets):
            n = ps.shape.numel()  # a paged parameter is an empty tensor between uses
            if ps.param.grad is not None:
                flat[offset:offset + n].copy_(ps.param.grad.detach().reshape(-1))
            else:
                flat[offset:offset + n].zero_()
            offset += n
        dist.reduce(flat, dst=dp.local[owner], group=dp.ctrl if len(dp.nodes) == 1 else dp.node_ctrl)
        if dp.local_rank != owner:
            return
        if len(dp.nodes) > 1:
            dist.all_reduce(flat, group=dp.cross_ctrl)  # the owners of every node: the global sum
        flat.div_(dp.world)
        offset = 0
        for b in buckets:
            n = params[b].shape.numel()
            dp.deliver(session, b, flat[offset:offset + n])
            offset += n


class _Flight(NamedTuple):
    bucket: int
    work: Any
    flat: torch.Tensor
    cross: bool  # the owners' all-reduce between the nodes (the second stage)


class StreamedReduction:
    """Reduces each bucket on the gradients' device as soon as this rank's last gradient of the
    step for it is in (`on_grad`), in `order` (every rank the same: the bucket order for the first
    step, then the order in which the first backward finished the buckets, `_learn_order`), so
    that the collectives match across ranks. A bucket that has no gradient yet holds back the ones after it
    until it has, or until `step()` launches what is left (`finish`). `streams = False` keeps every
    launch for `step()` (the same collectives in the same order)."""

    def __init__(self, dp: Any, device: torch.device, num_buckets: int) -> None:
        self.dp = dp
        self.device = device
        self.eager = device.type == "cuda"  # queued on streams at launch; else delivered as they finish
        self.streams = True
        self.order = list(range(num_buckets))
        self.learned = False  # the order of rank 0's first backward replaced the bucket order
        self.counts: dict[int, int] = {}  # bucket -> gradients of this step on this rank
        self.ready: set[int] = set()  # complete on this rank, not launched (waiting for the order)
        self.next = 0  # position in `order` of the next bucket to launch
        self.taken: set[int] = set()  # launched in this step (their gradients left p.grad)
        self.arrivals: list[int] = []  # this step's buckets in the order their last gradient came
        self.flights: deque[_Flight] = deque()  # collectives whose completion the host still handles
        # Eager: launched, oldest first, each kept (its tensors alive) until its collective is done.
        self.held: deque[_Flight] = deque()
        # The hyperparameters this step's first launch during backward found (rank 0 wrote them into
        # tsd then, before any owner could ring); None: nothing was launched before step().
        self.hyper: Optional[list[tuple[float, ...]]] = None
        self.error: Optional[BaseException] = None  # a collective that failed during backward

    # ---- backward
    def on_grad(self, session: Any, optimizer: torch.optim.Optimizer, ps: Any) -> None:
        """Backward's hook for one parameter: counts its gradient; the last of the step makes the
        bucket ready, and every ready bucket next in the order is launched."""
        b = ps.bucket
        if b in session.waits.pending:
            # overlap_forward, a use no pre-hook saw: take the last update before this step's can
            # overwrite the slot (the gradient came from the old weight, as for a single trainer).
            session.wait_updates([b])
            session.events.append(stale_use_event(ps.index))
        n = self.counts.get(b, 0) + 1
        self.counts[b] = n
        if n > session.accumulation_steps and (self.streams or b in self.taken):
            raise too_many_gradients(ps.index, n, session.accumulation_steps,
                                     "its gradients of this step were already being reduced over the group")
        if n != session.accumulation_steps:
            return
        self.arrivals.append(b)
        if not self.streams:
            return
        self.ready.add(b)
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            nb = self.order[self.next]
            self.next += 1
            self.ready.discard(nb)
            if self.hyper is None:  # before this step's first reduction, so before any owner rings
                self.hyper = session.group_hyper(optimizer)
                self.dp.write_hyper(session, self.hyper)
            self._launch(session, nb)
        if self.eager:
            self._release_done()
        else:
            self._poll(session, block=False)

    def _release_done(self) -> None:
        """Eager: lets go of the collectives that finished, oldest first, so that their gradients'
        memory returns to the allocator during backward (the owner's copy holds its tensor
        through the side stream: record_stream)."""
        while self.held and self.held[0].work.is_completed():
            self.held.popleft().work.wait()

    # ---- step()
    def finish(self, session: Any, stepped: list[int]) -> None:
        """At step(): launches the buckets of `stepped` not launched yet, in the order, waits for
        every collective of the step, then has the owners deliver what is left. Raises what failed."""
        if self.error is not None:
            raise self.error
        todo = set(stepped) - self.taken
        for b in self.order[self.next:]:
            if b in todo:
                self._launch(session, b)
        deliveries: list[tuple[int, torch.Tensor]] = []
        self._poll(session, block=True, out=deliveries)
        for f in self.held:
            f.work.wait()  # on the current stream: the collective's tensors may be released after it
        self.held.clear()
        for b, flat in deliveries:  # every collective of the step is done before these deliveries
            self.dp.deliver(session, b, flat)
        self._learn_order()

    def end_step(self) -> None:
        """Forgets the step (after step() delivered and waited for everything)."""
        self.counts.clear()
        self.ready.clear()
        self.taken.clear()
        self.arrivals = []
        self.next = 0
        self.hyper = None

    def _learn_order(self) -> None:
        """After the first step, every rank takes the same order, from the order in which the
        ranks' first backward finished the buckets: first those every rank finished, in rank 0's
        order; then those only some finished (they would hold the others back on the ranks that
        do not), then the rest, in bucket order."""
        if self.learned:
            return
        self.learned = True
        everyone: list[Any] = [None] * self.dp.world
        _dist().all_gather_object(everyone, self.arrivals, group=self.dp.ctrl)
        n = len(self.order)
        seen = [[b for b in arrived if 0 <= b < n] for arrived in everyone]
        common = set(seen[0]).intersection(*seen[1:])
        first = [b for b in seen[0] if b in common]
        some = [b for arrived in seen for b in arrived if b not in common]
        self.order = list(dict.fromkeys(first + some + list(range(n))))

    # ---- a bucket's collectives
    def _launch(self, session: Any, b: int) -> None:
        dist, dp = _dist(), self.dp
        ps = session.params[b]
        grad = ps.param.grad
        ps.param.grad = None
        self.taken.add(b)
        dtype = ps.grad_slot.dtype
        if grad is None:  # stepped for another rank's gradient: this rank adds zeros
            flat = torch.zeros(ps.shape.numel(), dtype=dtype, device=self.device)
        else:
            flat = grad.detach().reshape(-1)
            if flat.dtype != dtype or not flat.is_contiguous():
                flat = flat.to(dtype).contiguous()
        group = dp.group if len(dp.nodes) == 1 else dp.node_group
        work = dist.reduce(flat, dst=dp.local[dp.owner[b]], group=group, async_op=True)
        if not self.eager:
            self.flights.append(_Flight(b, work, flat, False))
            return
        if dp.local_rank != dp.owner[b]:
            self.held.append(_Flight(b, work, flat, False))
            return
        side = session.side_stream
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for the node's sum
            if len(dp.nodes) > 1:
                work = dist.all_reduce(flat, group=dp.cross_group, async_op=True)  # the owners': the global sum
                work.wait()
            self.held.append(_Flight(b, work, flat, len(dp.nodes) > 1))
            flat.div_(dp.world)
            dp.deliver(session, b, flat, stream=side)
            # The tensor came from the backward's stream; once let go of (held, after its collective),
            # the allocator must not reuse it before the side stream's copy out of it is done.
            flat.record_stream(side)

    def _poll(self, session: Any, block: bool, out: Optional[list[tuple[int, torch.Tensor]]] = None) -> None:
        """The host's part of collectives that finished, oldest first: the owner's second stage
        (several nodes) or its delivery (into `out` when given). `block`: waits for every one."""
        dist, dp = _dist(), self.dp
        while self.flights:
            f = self.flights[0]
            if not block and not f.work.is_completed():
                return
            try:
                f.work.wait()
            except BaseException as e:  # noqa: BLE001 - raised by step(): a hook must not end backward
                if block:
                    raise
                self.error = e
                return
            self.flights.popleft()
            if dp.local_rank != dp.owner[f.bucket]:
                continue
            if len(dp.nodes) > 1 and not f.cross:
                cross = dist.all_reduce(f.flat, group=dp.cross_group, async_op=True)  # the owners': the global sum
                self.flights.append(_Flight(f.bucket, cross, f.flat, True))
                continue
            f.flat.div_(dp.world)
            if out is not None:
                out.append((f.bucket, f.flat))
            else:
                dp.deliver(session, f.bucket, f.flat)
