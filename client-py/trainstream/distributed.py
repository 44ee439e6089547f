"""Data parallel: `wrap(..., distributed="auto" | True | False)` (docs/distributed.md).

The ranks of a `torch.distributed` group that share one tsd (one node) are sessions of one tsd job
and share its optimizer: the fp32 masters and the moments exist once per node, and tsd updates
each bucket once with all of the node's cores. How a step goes:

* Gradients: each bucket's gradient is reduced (summed, then divided by the world size, as DDP
  averages) onto the rank of the node that owns the bucket (`reduce` within the node), and with
  several nodes the owners of the same buckets on every node all-reduce their nodes' sums (so each
  gets the global sum and every node's tsd holds the same state). The owner writes it into the
  bucket's gradient slot and rings its doorbell; tsd steps it once. Where the group's backend
  reduces tensors on the gradients' device (NCCL for CUDA, gloo for the CPU) this runs bucket by
  bucket during backward, as each bucket's last gradient of the step comes; otherwise at `step()`
  through a host buffer (reduction.py). Micro-batches of gradient accumulation add up in `p.grad`
  first (`accumulation_steps=`). At `step()` the ranks agree which buckets got a gradient on any
  rank (one small all-reduce over a gloo group of their own), reduce what is left, and with
  `max_grad_norm` each rank commits: tsd clips by the global norm once every rank of the node
  committed (every bucket of the job is on that tsd).
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

import dataclasses
import os
import re
import socket as socket_mod
import time
from typing import Any, Callable, Optional, TypeVar

import torch

from . import _report
from .engine import hyper_changed
from .errors import TsdError
from .reduction import HostChunks, StreamedReduction, backend_for

__all__ = ["DataParallel", "check_option", "enabled"]

_T = TypeVar("_T")

# How the gradients cross the group: "auto" (on their device where the group's backend can,
# else through a host buffer at step()), "device" or "host" (reduction.py; tests force one).
REDUCTION = "auto"


def check_option(value: Any) -> None:
    """Refuses a `distributed=` value that is not "auto", True or False."""
    if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
        raise ValueError(f"distributed must be 'auto', True or False, not {value!r}")


def _dist() -> Any:
    import torch.distributed as dist
    return dist


def enabled(value: Any) -> bool:
    """Whether `distributed=value` trains data parallel here: "auto" when torch.distributed is
    initialized with more than one rank; True whenever it is initialized (a group of one rank
    included: the same results as one trainer, through the group's path), else a clear error."""
    check_option(value)
    if value is False:
        return False
    dist = _dist()
    initialized = dist.is_available() and dist.is_initialized()
    if value is True:
        if not initialized:
            raise ValueError("distributed=True needs torch.distributed initialized (torch.distributed."
                             "init_process_group, e.g. under torchrun); pass distributed='auto' to train in one "
                             "process when it is not")
        return True
    return initialized and dist.get_world_size() > 1


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
        # Small host collectives (flags, objects) and HostChunks' reductions run over gloo groups of
        # their own, whatever the group's backend, and apart from the reductions in flight.
        self.ctrl: Any = None
        # Several nodes: the group of this node's ranks, and that of the ranks with this local rank
        # on every node (the owners of the same buckets), whose all-reduce joins the nodes' sums;
        # each also over gloo.
        self.node_group: Any = None
        self.cross_group: Any = None
        self.node_ctrl: Any = None
        self.cross_ctrl: Any = None
        # Several nodes: every this many steps the nodes compare a checksum of their tsd's masters.
        self.check_every = 100
        self.reducer: Any = None  # reduction.StreamedReduction or HostChunks, chosen by finish_wrap()

    # ---- set-up
    @classmethod
    def start(cls, opts: dict[str, Any], client: Any) -> Optional["DataParallel"]:
        """For wrap(): None unless `opts["distributed"]` turns data parallel on; else the rank's
        DataParallel, after checking the other options and finding which ranks share this tsd
        (the node) and the job name (`job=`, else from the launch, else rank 0's)."""
        if not enabled(opts["distributed"]):
            return None
        if opts["param_offload"] == "auto":
            # The default: the weight planner decides per process from its own step, so ranks could page
            # differently (harmless, but not yet measured); name the blocks to page them.
            opts["param_offload"] = False
        if opts["optimizer_gpu_fraction"] == 1.0:
            raise ValueError("optimizer_gpu_fraction=1 keeps no update in tsd, so the ranks would share nothing "
                             "there: pass a number below 1 or 'auto' (or train with torch's DDP)")
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
        # Every rank makes every group, in the same order.
        dp.ctrl = dist.new_group(backend="gloo")
        if len(nodes) > 1:
            for backend in (None, "gloo"):
                node_groups = [dist.new_group(n, backend=backend) for n in nodes]
                cross_groups = [dist.new_group([n[j] for n in nodes], backend=backend) for j in range(dp.local_world)]
                if backend is None:
                    dp.node_group, dp.cross_group = node_groups[dp.node], cross_groups[dp.local_rank]
                else:
                    dp.node_ctrl, dp.cross_ctrl = node_groups[dp.node], cross_groups[dp.local_rank]
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

    def agree_share(self, share: Any, limited: Callable[[int], Any], tensors: int) -> Any:
        """The GPU share every rank takes (gpushare.ShareChoice): each rank's own choice is a
        prefix of the same candidates ("auto" from its own free VRAM), so all take the shortest,
        `limited(k)`, leaving tsd at least one tensor (the ranks share their optimizer there)."""
        dist = _dist()
        k = torch.tensor([min(len(share.ids), tensors - 1)], dtype=torch.int64)
        dist.all_reduce(k, op=dist.ReduceOp.MIN, group=self.ctrl)
        n = int(k.item())
        if n == len(share.ids):
            return share
        agreed = limited(n)
        return dataclasses.replace(agreed, why=f"{agreed.why}; {n} tensors, the smallest share of the group's ranks "
                                               f"(this rank alone chose {len(share.ids)})")

    def register(self, client: Any, request: dict[str, Any]) -> Any:
        """Registers (the node's first rank) or joins (the others, after it) the job's optimizer.
        Accumulation happens in `p.grad` before the reduction, so tsd gets one delivery per step."""
        dist = _dist()
        # Every rank planned (its memory check) before the first registers: none counts the
        # shared optimizer as already taken from the job's quota.
        dist.barrier(group=self.ctrl)
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
        dist.all_reduce(flags, group=self.ctrl)
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
        group = self.ctrl if len(self.nodes) == 1 else self.node_ctrl
        dist.broadcast_object_list(box, src=self.local[0], group=group)
        if isinstance(box[0], BaseException):
            if self.local_rank == 0:
                raise box[0]
            raise TsdError(f"rank {self.local[0]} (the first of this node) could not settle the resumed job "
                           f"{self.job!r}: {box[0]}")
        info, ahead_list = box[0]
        points: list[Any] = [None] * self.world
        dist.all_gather_object(points, (info.steps, list(info.bucket_steps), ahead_list), group=self.ctrl)
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
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.ctrl)
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

    def finish_wrap(self, session: Any) -> str:
        """The masters are written before any rank steps; chooses how the gradients cross the group
        (every rank the same; `REDUCTION`) and returns a line saying which."""
        dist = _dist()
        device = session.device
        backend = backend_for(self.group, device.type)
        can = torch.tensor([1 if backend is not None else 0], dtype=torch.int32)
        dist.all_reduce(can, op=dist.ReduceOp.MIN, group=self.ctrl)  # also the barrier: the masters are in
        on_device = REDUCTION == "device" or (REDUCTION == "auto" and int(can.item()) == 1)
        if on_device and backend is None:
            raise ValueError(f"the process group has no backend for {device.type} tensors (its backend: "
                             f"{dist.get_backend(self.group)}): it cannot reduce the gradients where they are")
        if on_device:
            self.reducer = StreamedReduction(self, device, len(session.params))
            return (f"gradients reduced on {device.type} through {backend}, bucket by bucket as backward "
                    f"finishes them")
        self.reducer = HostChunks(self)
        why = "" if REDUCTION == "host" else f" (the group has no backend for {device.type} tensors on every rank)"
        return f"gradients reduced at step() through a host buffer over gloo{why}"

    def write_hyper(self, session: Any, hyper: list[tuple[float, ...]]) -> None:
        """The node's first rank writes the step's hyperparameters into tsd (checked first), once
        the updates it still owes the model (overlap_forward) are done: tsd read the page for them."""
        session.check_hyper(hyper)
        if self.local_rank == 0:
            session.wait_updates()
            for gi, values in enumerate(hyper):
                session.handle.set_group(gi, *values)

    def deliver(self, session: Any, b: int, flat: torch.Tensor, stream: Any = None) -> None:
        """The owner's delivery of bucket b's reduced gradient `flat` into its slot (copied on
        `stream` and the doorbell rung from it, when given). Skips a bucket tsd already updated in
        this step before a rank died (resumed)."""
        if b in session.skip:
            return
        h = session.handle
        h.wait(b)  # the slot is free (its last delivery was taken)
        slot = session.params[b].grad_slot
        if stream is None:
            slot.copy_(flat)
            h.ready(b, True, True)
        else:
            slot.copy_(flat, non_blocking=True)
            h.ready_on_stream(stream.cuda_stream, b, True, True)

    # ---- a step
    def finish_step(self, session: Any, optimizer: torch.optim.Optimizer) -> None:
        """Reduces what is left of this step's gradients, has tsd step each bucket once (its
        owner delivers it) and copies every updated bucket back into the model."""
        try:
            changed = self._step(session, optimizer)
        except RuntimeError as e:
            if isinstance(e, TsdError):
                raise
            raise TsdError(f"data-parallel step {session.steps + 1} failed on rank {self.rank} of {self.world}: a "
                           f"collective over torch.distributed failed (did another rank die?): {e}") from e
        if changed is not None:
            raise hyper_changed(*changed)

    def _step(self, session: Any, optimizer: torch.optim.Optimizer) -> Optional[tuple[Any, Any]]:
        started = time.perf_counter()
        dist = _dist()
        h = session.handle
        params = session.params
        red = self.reducer
        if session.recorder is not None:  # overlap_forward: the first step ends the recording
            session.finish_recording(set_order=self.local_rank == 0)
        # Updates of the last step that this step's forward did not take (their modules did not
        # run) are completed now: nothing is owed for longer than one step.
        session.wait_updates()
        deferrable = session.waits.deferrable
        share = session.share  # optimizer_gpu_fraction: every rank updates the same share on its device
        entries = share.entries if share is not None else []
        has = torch.tensor([ps.param.grad is not None or b in red.taken for b, ps in enumerate(params)] +
                           [e.master.grad is not None for e in entries], dtype=torch.int32)
        dist.all_reduce(has, group=self.ctrl)
        stepped = [b for b in range(len(params)) if int(has[b]) > 0]
        share_stepped = [i for i in range(len(entries)) if int(has[len(params) + i]) > 0]
        hyper = session.group_hyper(optimizer)
        changed = None
        if red.hyper is None or (session.max_grad_norm > 0 and hyper != red.hyper):
            # Before any owner rings this step (nothing launched yet); with clipping tsd reads them
            # at the commit, so the values at step() count, as for a single trainer.
            self.write_hyper(session, hyper)
        elif hyper != red.hyper:
            changed = (red.hyper, hyper)  # tsd applied the values of the step's first reduction
        red.finish(session, stepped)
        if session.cuda:
            session.side_stream.synchronize()  # every doorbell of this step has been rung
        carried = False
        if share is not None:
            self._average_share(share, share_stepped)
            nb = session.norm_bucket
            if session.max_grad_norm > 0 and nb is not None:
                # The share's part of the global norm (the same on every rank) joins tsd's through
                # the norm bucket, which its owner delivers.
                self.expected[nb] += 1
                if self.local_rank == self.owner[nb]:
                    share.deliver_norm(session)
                carried = True
        skip = session.skip  # resumed: buckets tsd updated in this step before a rank died
        if session.max_grad_norm > 0 and (carried or any(b not in skip for b in stepped)):
            # tsd clips by the global norm once every rank of the node committed (a resumed step
            # whose commit tsd finished after a rank died delivers nothing, and commits nothing)
            h.commit(wait=False)
        for b in stepped:
            if b not in skip:
                self.expected[b] += 1
            ps = params[b]
            if b in deferrable and not ps.paged:  # overlap_forward: its module's next forward waits and copies
                session.deferred_versions[b] = ps.param._version
                session.waits.defer(b)
                continue
            h.wait_steps(b, self.expected[b])
            if ps.paged:  # param_offload: its slot is its only copy, which the pager brings in at its next use
                continue
            p = ps.param
            with torch.no_grad():
                p.view(p.shape).copy_(ps.param_slot.view(p.shape))
            ps.version = p._version
        for ps in params:
            ps.param.grad = None
        if share is not None:
            share.step(optimizer, session)  # on the device, clipped by the global norm tsd computed
        if session.marks is not None:  # the node's first rank, for a kept job (resume.py)
            session.marks.record(session.steps + 1, set(stepped) | skip)
        skip.clear()
        red.end_step()
        session.steps += 1
        if session.pager is not None:  # param_offload: frees what is still on the device
            session.pager.after_step()
        if self.local_rank == 0:  # the job's activity (tsctl top): the node's first rank's step
            _report.report_step(session, started)
        if len(self.nodes) > 1 and session.steps % self.check_every == 0:
            self._check_nodes_agree(session)
        return changed

    def _average_share(self, share: Any, stepped: list[int]) -> None:
        """Averages the GPU share's gradients over the world, as DDP does, so that every rank
        updates the same share the same way: on the device where the group's backend reduces
        there, else through the host over gloo. A parameter that got a gradient on some ranks
        only adds the others' zeros; one that got none anywhere keeps none (AdamW skips it)."""
        dist = _dist()
        on_device = isinstance(self.reducer, StreamedReduction)
        for i in stepped:
            e = share.entries[i]
            if e.master.grad is None:
                e.master.grad = torch.zeros_like(e.master)
            g = e.master.grad
            if on_device:
                dist.all_reduce(g, group=self.group)
            else:
                host = g.detach().cpu()
                dist.all_reduce(host, group=self.ctrl)
                g.copy_(host)
            g.div_(self.world)

    def _check_nodes_agree(self, session: Any) -> None:
        """Every node's tsd must hold the same masters (each stepped the same reduced gradients):
        compares an exact checksum of their bits between the nodes; raises on every rank if one
        differs."""
        dist = _dist()
        session.wait_updates()  # overlap_forward: every update of this step is in
        total = 0
        for ps in session.params:
            total = (total + int(ps.master.view(torch.int32).sum(dtype=torch.int64))) % (1 << 61)
        sums: list[Any] = [None] * self.world
        dist.all_gather_object(sums, (self.node, total), group=self.ctrl)
        by_node = {node: value for node, value in sums}
        if len(set(by_node.values())) > 1:
            raise TsdError(f"the nodes' optimizer states diverged at step {session.steps} (checksums of the masters by "
                           f"node: {by_node}): the nodes no longer train the same model; stop and restart from a "
                           f"checkpoint")
