"""Data parallel: `wrap(..., distributed="auto" | True | False)` (docs/distributed.md).

The ranks of a `torch.distributed` group that share one tsd (one node) are sessions of one tsd job
and share its optimizer: the fp32 masters and the moments exist once per node, and tsd updates
each bucket once with all of the node's cores. How a step goes:

* Backward leaves the gradients in `p.grad` (no per-gradient delivery): micro-batches of gradient
  accumulation add up there, and the gradients are reduced once per `step()`, as DDP's `no_sync`.
* `step()`: the ranks agree which buckets got a gradient on any rank (one small all-reduce), then
  each bucket's gradient is reduced (summed, divided by the world size, as DDP averages) to the
  rank of the node that owns the bucket (`reduce` within the node), and with several nodes the
  owners of the same buckets on every node all-reduce their nodes' sums (so each gets the global
  sum and every node's tsd holds the same state). The owner writes it into the bucket's gradient slot and rings
  its doorbell; tsd steps it once. With `max_grad_norm`, each rank commits and tsd clips by the
  global norm once every rank of the node committed: every bucket of the job is on that tsd.
* Every rank copies each updated bucket back from the shared parameter slot once tsd's step
  count of the bucket says the update is there.

Buckets are spread over a node's ranks by size (largest first, onto the least loaded), the same
on every rank and every node. A rank that dies fails the step on the others: their collective
fails, or tsd (which sees the rank's session end) fails the job's optimizer, and every wait on it
raises saying which rank was lost. That failure leaves tsd's state whole: a job kept with
`keep_for` is resumed by a restarted group of as many ranks per node, each passing
`resume=True` (resume.py; `rank_spec`, `everyone`, `settle_resume`): tsd settles the step
that was cut (with clipping it is rolled back; without, buckets already updated are skipped
once) and every rank continues from the same step.
"""
from __future__ import annotations

import os
import re
import socket as socket_mod
from typing import Any, Callable, Optional, TypeVar

import torch

from .errors import TsdError

__all__ = ["DataParallel", "check_option", "enabled"]

_T = TypeVar("_T")

# The gradients of a step cross the group in chunks of about this many bytes (one host buffer).
REDUCE_CHUNK_BYTES = 64 << 20

# wrap() options that do not work with distributed= yet, and the values they must keep.
_UNSUPPORTED = {"overlap_forward": False, "param_offload": False, "optimizer_gpu_fraction": 0.0}


def check_option(value: Any) -> None:
    """Refuses a `distributed=` value that is not "auto", True or False."""
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"distributed must be 'auto', True or False, not {value!r}")


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def enabled(value: Any) -> bool:
    """Whether `distributed=value` trains data parallel here: "auto" when torch.distributed is
    initialized with more than one rank; True requires that (else a clear error)."""
    check_option(value)
    if value is False:
        return False
    dist = _dist()
    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if value is True and not on:
        raise ValueError("distributed=True needs torch.distributed initialized with more than one rank "
                         "(torch.distributed.init_process_group, e.g. under torchrun); pass distributed='auto' "
                         "to train in one process when it is not")
    return on


def _job_from_launch() -> Optional[str]:
    """A job name all ranks of one launch agree on: from TORCHELASTIC_RUN_ID (torchrun), else the
    rendezvous address (MASTER_ADDR:MASTER_PORT); None when neither is set."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        key = run_id
    elif os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        key = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    else:
        return None
    return "trainstream-dp-" + re.sub(r"[^A-Za-z0-9._:-]", "_", key)[:100]


class DataParallel:
    """One rank's part in data-parallel training: its place in the group (global and within its
    node), the job the node's ranks share, which rank of the node owns each bucket, and the
    per-step protocol (`finish_step`). Made by `wrap()` through `DataParallel.start` before the
    job is attached."""

    def __init__(self, group: Any, job: str, nodes: list[list[int]]) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.job = job
        self.nodes = nodes  # the global ranks of each node (sharing one tsd), lowest first
        self.node = next(i for i, n in enumerate(nodes) if self.rank in n)
        self.local = nodes[self.node]
        self.local_rank = self.local.index(self.rank)
        self.local_world = len(self.local)
        self.owner: list[int] = []     # bucket -> the local rank that delivers it to tsd
        self.expected: list[int] = []  # bucket -> tsd's step count once this rank's last step is in
        # Several nodes: the group of this node's ranks, and that of the ranks with this local rank
        # on every node (the owners of the same buckets), whose all-reduce joins the nodes' sums.
        self.node_group: Any = None
        self.cross_group: Any = None
        # Several nodes: every this many steps the nodes compare a checksum of their tsd's masters.
        self.check_every = 100
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # host staging of the reductions, by dtype

    # ---- set-up
    @classmethod
    def start(cls, opts: dict[str, Any], client: Any) -> Optional["DataParallel"]:
        """For wrap(): None unless `opts["distributed"]` turns data parallel on; else the rank's
        DataParallel, after checking the other options and finding which ranks share this tsd
        (the node) and the job name (`job=`, else from the launch, else rank 0's)."""
        if not enabled(opts["distributed"]):
            return None
        if opts["param_offload"] == "auto":
            opts["param_offload"] = False  # the default: weight paging is not supported with data parallel yet
        for name, value in _UNSUPPORTED.items():
            if opts[name] != value:
                raise ValueError(f"{name}={opts[name]!r} is not supported with distributed data parallel yet; "
                                 f"pass {name}={value!r} (or distributed=False)")
        if opts["activation_offload"] not in (False, None, "auto"):
            raise ValueError("activation_offload is not supported with distributed data parallel yet; pass "
                             "activation_offload=False (or distributed=False)")
        dist = _dist()
        group = dist.group.WORLD
        job = opts["job"] or _job_from_launch()
        status = client.status()
        me = (socket_mod.gethostname(), os.path.realpath(client.socket_path), int(status.pid), job)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, me, group=group)
        jobs = {e[3] for e in everyone}
        if len(jobs) != 1:
            raise ValueError(f"the ranks do not agree on the job's name ({sorted(map(str, jobs))}, from job= or "
                             f"TORCHELASTIC_RUN_ID / MASTER_ADDR:MASTER_PORT); pass the same job= on every rank")
        if job is None:  # no name from the launch on any rank: rank 0's
            names: list[Any] = [f"trainstream-dp-{socket_mod.gethostname()}-{os.getpid()}"]
            dist.broadcast_object_list(names, src=0, group=group)
            job = names[0]
        keys: dict[tuple[str, str, int], list[int]] = {}
        for r, (host, path, pid, _) in enumerate(everyone):
            keys.setdefault((host, path, pid), []).append(r)
        nodes = sorted(keys.values())
        sizes = {len(n) for n in nodes}
        if len(sizes) != 1:
            raise ValueError(f"every node needs the same number of ranks (ranks sharing one tsd: "
                             f"{[len(n) for n in nodes]}); launch as many ranks on each node")
        assert job is not None
        dp = cls(group, job, nodes)
        if len(nodes) > 1:  # every rank makes every group, in the same order
            node_groups = [dist.new_group(n) for n in nodes]
            cross_groups = [dist.new_group([n[j] for n in nodes]) for j in range(dp.local_world)]
            dp.node_group, dp.cross_group = node_groups[dp.node], cross_groups[dp.local_rank]
        return dp

    def assign(self, numels: list[int]) -> None:
        """Spreads the buckets over the node's ranks: largest first, onto the least loaded
        (ties: the lower rank), so the same on every rank."""
        load = [0] * self.local_world
        self.owner = [0] * len(numels)
        for b in sorted(range(len(numels)), key=lambda b: (-numels[b], b)):
            r = min(range(self.local_world), key=lambda r: (load[r], r))
            self.owner[b] = r
            load[r] += numels[b]

    def rank_spec(self, request: dict[str, Any]) -> dict[str, Any]:
        """This rank's registration (or resume) of the optimizer `request` describes: one delivery
        per step (accumulation happens before the reduction), the buckets assigned to their owners,
        and with several ranks on the node this rank of the node's `local_world` (tsd checks that
        every rank gives the same world)."""
        spec = dict(request, accumulate=False)
        self.assign([n for (_, n, _, _) in spec["buckets"]])
        if self.local_world > 1:
            spec.update(rank=self.local_rank, world=self.local_world)
        return spec

    def register(self, client: Any, request: dict[str, Any]) -> Any:
        """Registers (the node's first rank) or joins (the others, after it) the job's optimizer.
        Accumulation happens in `p.grad` before the reduction, so tsd gets one delivery per step."""
        dist = _dist()
        # Every rank planned (its memory check) before the first registers: none counts the
        # shared optimizer as already taken from the job's quota.
        dist.barrier(group=self.group)
        spec = self.rank_spec(request)
        if self.local_world == 1:
            handle = client._register_optimizer(**spec)
            self.expected = [int(handle.steps(b)) for b in range(handle.num_buckets)]
            return handle
        handle = self._first_then_all(lambda: client._register_optimizer(**spec), "register the job's optimizer")
        if self.local_rank != 0:
            handle = client._register_optimizer(**spec)
        assert handle is not None
        self.expected = [int(handle.steps(b)) for b in range(handle.num_buckets)]
        return handle

    # ---- resuming a kept job (resume.py)
    def everyone(self, work: Callable[[], Any], what: str) -> Any:
        """Runs `work` on every rank; if it raises on any rank, every rank raises (the others
        saying which failed), so no rank goes on alone."""
        dist = _dist()
        error: Optional[BaseException] = None
        result = None
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
        flags = torch.zeros(self.world, dtype=torch.int32)
        flags[self.rank] = 0 if error is None else 1
        dist.all_reduce(flags, group=self.group)
        if error is not None:
            raise error
        failed = [r for r in range(self.world) if int(flags[r])]
        if failed:
            raise TsdError(f"rank(s) {failed} of the group could not {what} (job {self.job!r}); see their errors")
        return result

    def settle_resume(self, settle: Callable[[], tuple[Any, Any, set[int]]]) -> tuple[Any, Any, set[int]]:
        """After every rank resumed: the node's first rank runs `settle` (it reads and rewrites
        the node's step marks) and gives its ResumeInfo and the buckets to skip to the node's
        other ranks; then every rank checks that the whole group continues from the same step
        and takes tsd's step counts as those its next step waits past. Returns (info, marks or
        None on the other ranks, the buckets whose next delivery is skipped)."""
        dist = _dist()
        marks = None
        box: list[Any] = [None]
        if self.local_rank == 0:
            try:
                info, marks, ahead = settle()
                box[0] = (info, sorted(ahead))
            except BaseException as e:  # noqa: BLE001 - every rank raises it below
                box[0] = e
        group = self.group if len(self.nodes) == 1 else self.node_group
        dist.broadcast_object_list(box, src=self.local[0], group=group)
        if isinstance(box[0], BaseException):
            if self.local_rank == 0:
                raise box[0]
            raise TsdError(f"rank {self.local[0]} (the first of this node) could not settle the resumed job "
                           f"{self.job!r}: {box[0]}")
        info, ahead_list = box[0]
        points: list[Any] = [None] * self.world
        dist.all_gather_object(points, (info.steps, list(info.bucket_steps), ahead_list), group=self.group)
        if any(p != points[0] for p in points):
            raise TsdError(f"the ranks resumed job {self.job!r} at different points ((steps, tsd's step count of each "
                           f"bucket, buckets ahead) by rank: {points}); the nodes' kept states differ, so the run "
                           f"cannot continue from them: restart it from a checkpoint")
        self.expected = [int(x) for x in info.bucket_steps]
        return info, marks, set(ahead_list)

    def _first_then_all(self, action: Callable[[], _T], what: str) -> Optional[_T]:
        """Runs `action` on the node's first rank while the others wait, then lets every rank go
        on only if it succeeded: the first rank raises its own error, the others one that points
        to it. Returns what `action` returned on the first rank, None on the others."""
        dist = _dist()
        result: Optional[_T] = None
        error: Optional[BaseException] = None
        if self.local_rank == 0:
            try:
                result = action()
            except BaseException as e:  # the other ranks must not go on with what did not happen
                error = e
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if error is not None:
            raise error
        if int(ok.item()) == 0:
            raise TsdError(f"rank {self.local[0]} (the first of this node) could not {what}; see its error")
        return result

    def load_state(self, session: Any, load: Callable[[], None]) -> None:
        """Loads optimizer state into the node's one optimizer: every rank of the group calls it
        (as it calls step()); the node's first rank runs `load`, the others wait for it, and then
        every rank takes tsd's step counts as those its next step waits past (a loaded state
        carries its own). If the load fails, every rank raises."""
        self._first_then_all(load, "load the optimizer's state into the node's tsd")
        h = session.handle
        self.expected = [int(h.steps(b)) for b in range(h.num_buckets)]

    @property
    def writes_masters(self) -> bool:
        """Whether this rank initialises the shared masters (the node's first rank)."""
        return self.local_rank == 0

    def broadcast_parameters(self, params: list[torch.nn.Parameter]) -> None:
        """Gives every rank rank 0's parameters, as DDP does at construction."""
        dist = _dist()
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0, group=self.group)

    def finish_wrap(self) -> None:
        """The masters are written before any rank steps."""
        _dist().barrier(group=self.group)

    # ---- a step
    def finish_step(self, session: Any, optimizer: torch.optim.Optimizer) -> None:
        """Reduces this step's gradients, has tsd step each bucket once (its owner delivers it)
        and copies every updated bucket back into the model."""
        try:
            self._step(session, optimizer)
        except RuntimeError as e:
            if isinstance(e, TsdError):
                raise
            raise TsdError(f"data-parallel step {session.steps + 1} failed on rank {self.rank} of {self.world}: a "
                           f"collective over torch.distributed failed (did another rank die?): {e}") from e

    def _step(self, session: Any, optimizer: torch.optim.Optimizer) -> None:
        dist = _dist()
        h = session.handle
        params = session.params
        has = torch.tensor([ps.param.grad is not None for ps in params], dtype=torch.int32)
        dist.all_reduce(has, group=self.group)
        stepped = [b for b in range(len(params)) if int(has[b]) > 0]
        hyper = session.group_hyper(optimizer)
        session.check_hyper(hyper)
        if self.local_rank == 0:
            for gi, values in enumerate(hyper):  # before any owner rings (the reductions order it)
                h.set_group(gi, *values)
        for owner in range(self.local_world):
            mine = [b for b in stepped if self.owner[b] == owner]
            by_dtype: dict[torch.dtype, list[int]] = {}
            for b in mine:
                by_dtype.setdefault(params[b].grad_slot.dtype, []).append(b)
            for dtype, buckets in by_dtype.items():
                self._reduce(session, buckets, dtype, owner)
        skip = session.skip  # resumed: buckets tsd updated in this step before a rank died
        if session.max_grad_norm > 0 and any(b not in skip for b in stepped):
            # tsd clips by the global norm once every rank of the node committed (a resumed step
            # whose commit tsd finished after a rank died delivers nothing, and commits nothing)
            h.commit(wait=False)
        for b in stepped:
            if b not in skip:
                self.expected[b] += 1
            h.wait_steps(b, self.expected[b])
            ps = params[b]
            p = ps.param
            with torch.no_grad():
                p.view(p.shape).copy_(ps.param_slot.view(p.shape))
            ps.version = p._version
        for ps in params:
            ps.param.grad = None
        if session.marks is not None:  # the node's first rank, for a kept job (resume.py)
            session.marks.record(session.steps + 1, set(stepped) | skip)
        skip.clear()
        session.steps += 1
        if len(self.nodes) > 1 and session.steps % self.check_every == 0:
            self._check_nodes_agree(session)

    def _check_nodes_agree(self, session: Any) -> None:
        """Every node's tsd must hold the same masters (each stepped the same reduced gradients):
        compares an exact checksum of their bits between the nodes; raises on every rank if one
        differs."""
        dist = _dist()
        total = 0
        for ps in session.params:  # every update of this step is in (waited for above)
            total = (total + int(ps.master.view(torch.int32).sum(dtype=torch.int64))) % (1 << 61)
        sums: list[Any] = [None] * self.world
        dist.all_gather_object(sums, (self.node, total), group=self.group)
        by_node = {node: value for node, value in sums}
        if len(set(by_node.values())) > 1:
            raise TsdError(f"the nodes' optimizer states diverged at step {session.steps} (checksums of the masters by "
                           f"node: {by_node}): the nodes no longer train the same model; stop and restart from a "
                           f"checkpoint")

    def _reduce(self, session: Any, buckets: list[int], dtype: torch.dtype, owner: int) -> None:
        """Sums the buckets' gradients onto the owning rank of each node, averages them over the
        world, and has the owner deliver each to tsd: in chunks of about `REDUCE_CHUNK_BYTES`
        (a larger bucket is a chunk of its own), through one host buffer reused for every chunk,
        so a rank's host memory for the reduction is bounded by a chunk, not its share of the model."""
        params = session.params
        limit = max(1, REDUCE_CHUNK_BYTES // dtype.itemsize)
        chunk: list[int] = []
        size = 0
        for b in buckets:
            n = params[b].param.numel()
            if chunk and size + n > limit:
                self._reduce_chunk(session, chunk, dtype, owner, size)
                chunk, size = [], 0
            chunk.append(b)
            size += n
        if chunk:
            self._reduce_chunk(session, chunk, dtype, owner, size)

    def _staging(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A host buffer of at least `numel` elements of `dtype`, kept for the next step."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[dtype] = buf
        return buf[:numel]

    def _reduce_chunk(self, session: Any, buckets: list[int], dtype: torch.dtype, owner: int, numel: int) -> None:
        dist = _dist()
        params = session.params
        flat = self._staging(dtype, numel)
        offset = 0
        for ps in (params[b] for b in buckets):
            n = ps.param.numel()
            if ps.param.grad is not None:
                flat[offset:offset + n].copy_(ps.param.grad.detach().reshape(-1))
            else:
                flat[offset:offset + n].zero_()
            offset += n
        if len(self.nodes) == 1:
            dist.reduce(flat, dst=self.local[owner], group=self.group)
        else:
            dist.reduce(flat, dst=self.local[owner], group=self.node_group)  # the node's sum, on its owner
        if self.local_rank != owner:
            return
        if len(self.nodes) > 1:
            dist.all_reduce(flat, group=self.cross_group)  # the owners of every node: the global sum
        flat.div_(self.world)
        h = session.handle
        offset = 0
        for b in buckets:
            ps = params[b]
            n = ps.param.numel()
            if b in session.skip:  # resumed: tsd applied this step's update before a rank died
                offset += n
                continue
            h.wait(b)  # the slot is free (its last delivery was taken)
            ps.grad_slot.copy_(flat[offset:offset + n])
            h.ready(b, True, True)
            offset += n
