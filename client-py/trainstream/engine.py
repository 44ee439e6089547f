"""The per-step protocol with tsd: a wrapped model's `Session`.

How a step flows (docs/python.md has the user's view):

* `wrap()` registers every trainable parameter with the daemon as its own bucket, in reverse
  order of registration (last layers first: backward produces them first). One bucket per tensor
  keeps torch's semantics exactly: a parameter that gets no gradient in a step is not delivered,
  so its moments and step count stay untouched, as in torch.optim.AdamW; and the daemon still
  splits large tensors across its threads. The fp32 master weights are initialised from the
  parameters.
* Backward: a post-accumulate-grad hook (`Session.on_grad`) copies each gradient into its
  bucket's grad slot (on CUDA: D2H on a side stream into the pinned slot, and the doorbell is
  rung from that stream once the copy is done), rings the bucket's doorbell, and frees the
  gradient. The daemon updates the bucket while backward goes on.
* `step()` (`Session.finish_step`): with `max_grad_norm`, commits the step (the daemon clips by
  the global norm). Then, with `overlap_forward=False`, it waits for the buckets and copies the
  updated parameters back into the model (H2D on CUDA), the default. With `overlap_forward=True`
  it returns once every bucket is handed over: the first step's forward is recorded
  (`prefetch.ForwardOrder`), tsd updates the buckets in that order, and each module's forward
  pre-hook waits for and copies only its own buckets (`prefetch.UpdateWaits`); everything else
  that reads a parameter or a slot goes through `wait_updates()` first.

Hyperparameters come from `param_groups` (so LR schedulers work). Without clipping, updates run
during backward, so the values are taken at the step's first gradient; `finish_step()` checks
that they did not change in between. With clipping, they are written at the step's first gradient
(a speculated update, docs/optimizer.md, uses them) and again at `step()`, and the daemon uses those
at the commit (redoing speculated updates if they changed); the next step's values are written only once every pending
update was taken (`write_hyper` waits for them), so a scheduler stepping right after `step()`
does not touch pending updates.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Optional, Union

import torch

from . import _report, _state
from .allocator import SegmentSwitch
from .client import Client
from .errors import TsdError, error_class
from .memory import HostArena, PinnedHost
from .paging.activations import ActivationPager
from .paging.weights import WeightPager
from . import planner
from .planner import Budget
from .prefetch import ForwardOrder, UpdateWaits, owners_of, stale_use_event, wait_modules

# One bucket's optimizer state as flat tensors: (fp32 master, exp_avg, exp_avg_sq, step).
BucketState = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def hyper_changed(was: list[tuple[float, ...]], now: list[tuple[float, ...]]) -> RuntimeError:
    """The error for hyperparameters changed between backward and step() without clipping: tsd
    already applied the step's updates with the values of its first gradient."""
    g = next(i for i, (a, c) in enumerate(zip(was, now)) if a != c)
    return RuntimeError(
        f"param_groups[{g}] changed between backward and step() (lr, betas, eps, weight_decay were {was[g]}, "
        f"now {now[g]}): tsd applied this step's update while backward ran, with the values at the step's "
        f"first gradient. Change hyperparameters before backward (LR schedulers do: call scheduler.step() "
        f"after optimizer.step()), or pass max_grad_norm to wrap() (updates then run at step())")


def too_many_gradients(index: int, n: int, steps: int, why: str) -> RuntimeError:
    """The error for parameter `index`'s gradient number `n` in a step of `steps` accumulations
    (`why`: what already happened to the step's gradient)."""
    return RuntimeError(
        f"parameter {index} received gradient number {n} before optimizer.step(), with accumulation_steps={steps}: "
        f"{why}. For gradient accumulation over N backward passes per step() pass accumulation_steps=N to "
        f"trainstream.wrap()")


class ParamSlots:
    """One trainable parameter: its bucket and the tensors aliasing the bucket's slots."""

    __slots__ = ("param", "bucket", "group", "index", "master", "grad_slot", "param_slot", "version", "hook",
                 "orig_dtype", "paged", "shape")

    def __init__(self, param: torch.nn.Parameter, bucket: int, group: int, index: int) -> None:
        self.param, self.bucket, self.group, self.index = param, bucket, group, index
        # 1-D tensors aliasing the bucket's slots in tsd's memory (set by wrap(), dropped at release).
        self.master: Any = None
        self.grad_slot: Any = None
        self.param_slot: Any = None
        self.hook: Optional[torch.utils.hooks.RemovableHandle] = None
        self.version = -1
        self.orig_dtype = param.dtype  # before param_dtype= cast it (restored by unwrap / the switch to stock)
        self.paged = False  # its block's weights are paged (paging.weights): the param slot is its only copy
        self.shape = param.shape  # a paged parameter is an empty tensor between uses: its shape is this


class Session:
    """One wrapped model's link to tsd: the client, the registered optimizer, the hooks, the
    host arena the activation pager draws from, and the per-step bookkeeping.
    `trainstream.unwrap_session(model)` returns it. `budget` is what the caller passed to wrap()
    (its None fields are measured when needed)."""

    def __init__(self, device: Union[str, torch.device], client: Client, owns_client: bool, options: dict[str, Any],
                 budget: Optional[Budget] = None) -> None:
        self.budget = budget if budget is not None else Budget()
        self.arena: Optional[HostArena] = None  # with activation_offload=: host memory lent by tsd
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.client: Optional[Client] = client
        self.owns_client = owns_client
        self.max_grad_norm = float(options["max_grad_norm"] or 0.0)
        self.accumulation_steps = int(options["accumulation_steps"])
        self.check_memory = bool(options.get("check_memory", True))
        # wrap(expandable_segments=): the allocator's segments once a budget binds (allocator.py)
        self.segments = SegmentSwitch(options.get("expandable_segments", False), self.cuda)
        self.offload = options["offload"]
        self.param_dtype = options.get("param_dtype")
        self.act_pager: Optional[ActivationPager] = None  # with activation_offload=
        self.pager: Optional[WeightPager] = None  # with param_offload= (TrainStream's name for it)
        self.planner: Any = None  # param_offload="auto": the blockplan.MemoryPlanner the pager consults each step
        self.memory_plan: Any = None  # planner.Plan: what check_memory computed at wrap() (host_bytes of host_room)
        self.activation_host_bytes = 0  # activation pages the first step's check admitted (optim.check_activation_host)
        self.moment_dtype = "float32"  # set by wrap()
        self.state_bytes = 0
        self.events: list[str] = []  # human-readable decisions, for logs and tests
        self.handle: Any = None  # the extension's Optimizer
        self.params: list[ParamSlots] = []      # by bucket
        self.by_param: dict[int, ParamSlots] = {}  # id(param) -> its slots
        self.param_names: dict[int, str] = {}  # id(param) -> its name in the model (for messages)
        # Kept and resumed jobs (resume.py): the step marks, the buckets whose deliveries the first
        # resumed step skips (updated already in the step the dead trainer was in), what resume found.
        self.marks: Any = None
        self.skip: set[int] = set()
        self.resumed: Any = None
        self.closed = False
        self.failure: Optional[TsdError] = None  # what ended the session's use of tsd, if tsd did
        self.offloading = True
        # Per-step state.
        self.counts: dict[int, int] = {}  # bucket -> gradients delivered in this step
        self.pending: set[int] = set()    # buckets with non-final deliveries in this step
        self.finaled: set[int] = set()    # buckets with a final delivery in this step
        self.hyper: Optional[list[tuple[float, ...]]] = None  # hyperparameters written for this step, per group
        self.steps = 0            # optimizer steps applied
        self.step_times: list[float] = []
        self.side_stream: Any = torch.cuda.Stream(device=self.device) if self.cuda else None
        # overlap_forward=True: updates finish during the next forward (prefetch.py). `recorder`
        # watches forwards until the first step; `waits` holds the buckets still owed.
        self.model: Optional[torch.nn.Module] = None  # set by wrap() (the recorder's and waits' hooks)
        self.recorder: Optional[ForwardOrder] = None
        self.waits = UpdateWaits(self.complete_update)
        self.forward_order: list[int] = []  # the buckets in the order the recorded forward used them
        self.deferred_versions: dict[int, int] = {}  # bucket -> its parameter's _version when deferred
        # optimizer_gpu_fraction: the share updated on the device (gpushare.GpuShare), and with
        # clipping tsd's extra bucket that carries its gradients' norm into the commit.
        self.share: Any = None
        self.norm_bucket: Optional[int] = None
        # optimizer_gpu_fraction="auto": what the decision after a measured step needs
        # (share_auto.Pending; None once decided), and the buckets it moved into the share (their
        # ParamSlots stay in `params`, by bucket, but leave `by_param`: tsd gets no more gradients for them).
        self.auto_share: Any = None
        self.act_refine: Any = None  # activation_offload="auto"'s pages, left for activation_auto.maybe_refine
        # The step after which activation_offload="auto" last changed what is paged or recomputed:
        # the decisions made from a measured peak (the GPU share, offload="auto") wait for a step after it.
        self.activations_changed_at = -1
        self.recompute: Any = None  # paging.recompute.Recomputer: the blocks recomputed in backward
        self.recompute_auto = False  # activation_recompute="auto": what the first decision takes off is recomputed
        self.head_check: Any = None  # paging.first_step's hook handle, until the first training forward
        self.moved: set[int] = set()
        self.retired_bytes = 0  # host memory tsd returned to its pool when the moved buckets retired
        self.norm_slot: Any = None
        # distributed=: the rank's distributed.DataParallel; gradients then stay in p.grad until
        # step(), whose reduction and delivery it does (finish_step hands over to it).
        self.dp: Any = None
        # For measurement (bench/): when a list, each wait for a bucket's update appends
        # (bucket, taken_ns, began_ns, ended_ns, published_ns, got_ns): tsd's stamps of the update
        # just waited for (the control page's, CLOCK_MONOTONIC) and when the wait returned.
        self.timeline: Optional[list[tuple[int, int, int, int, int, int]]] = None

    # ---- hyperparameters
    def group_hyper(self, optimizer: torch.optim.Optimizer) -> list[tuple[float, ...]]:
        out = []
        for g in optimizer.param_groups:
            b1, b2 = g["betas"]
            out.append(tuple(float(x) for x in (g["lr"], b1, b2, g["eps"], g["weight_decay"])))
        return out

    @staticmethod
    def check_hyper(hyper: list[tuple[float, ...]]) -> None:
        """Refuses, naming the group and the value, hyperparameters AdamW cannot use: they are checked here,
        before they reach the control page, where a bad one is a protocol violation that closes the optimizer."""
        for gi, (lr, b1, b2, eps, wd) in enumerate(hyper):
            bad = None
            if not (math.isfinite(lr) and lr >= 0):
                bad = f"lr = {lr} (must be finite and >= 0)"
            elif not 0 <= b1 < 1:
                bad = f"betas[0] = {b1} (must be in [0, 1))"
            elif not 0 <= b2 < 1:
                bad = f"betas[1] = {b2} (must be in [0, 1))"
            elif not (math.isfinite(eps) and eps > 0):
                bad = f"eps = {eps} (must be finite and > 0)"
            elif not (math.isfinite(wd) and wd >= 0):
                bad = f"weight_decay = {wd} (must be finite and >= 0)"
            if bad is not None:
                raise ValueError(f"param_groups[{gi}]: {bad}; nothing was sent to tsd: fix the value (or the "
                                 f"scheduler that produced it)")

    def write_hyper(self, optimizer: torch.optim.Optimizer) -> None:
        hyper = self.group_hyper(optimizer)
        self.check_hyper(hyper)
        # Updates still owed were dispatched with the page's current values only once the daemon
        # took them: take them all before the page changes (normally the forward already did).
        self.wait_updates()
        self.hyper = hyper
        for gi, h in enumerate(self.hyper):
            self.handle.set_group(gi, *h)

    def fail(self, error: TsdError) -> None:
        """Marks the session as ended by `error` (the daemon died, closed the session, ...): every
        later step() raises the same error again."""
        self.closed = True
        self.failure = error

    # ---- the gradient hook
    def on_grad(self, optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None or not self.offloading:
            return
        if self.closed:
            if self.failure is not None:
                raise type(self.failure)(self.failure.message, self.failure.code)
            raise TsdError("this model was unwrapped; wrap it again to train it")
        ps = self.by_param[id(p)]
        if self.dp is not None:  # data parallel: reduced over the group, then delivered (distributed.py)
            self.dp.reducer.on_grad(self, optimizer, ps)
            return
        b = ps.bucket
        if b in self.skip:  # resumed: tsd applied this bucket's update of this step before the crash
            p.grad = None
            return
        if b in self.waits.pending:
            # Its forward ran without completing it (a use no pre-hook saw): the daemon may still read
            # its slots. Take the update before the slot is written; the gradient came from the old weight.
            self.wait_updates([b])
            self.events.append(stale_use_event(ps.index))
        n = self.counts.get(b, 0) + 1
        if b in self.finaled:
            raise too_many_gradients(ps.index, n, self.accumulation_steps, "tsd already took its last gradient of this step")
        final = n == self.accumulation_steps
        first = n == 1
        if first and p._version != ps.version:
            self.sync_master(ps)  # the parameter was changed outside the optimizer (e.g. load_state_dict)
        try:
            if final and self.hyper is None:
                self.write_hyper(optimizer)
            self.deliver(ps, grad, first, final)
        except TsdError as e:
            self.fail(e)
            raise
        p.grad = None
        self.counts[b] = n
        if final:
            self.pending.discard(b)
            self.finaled.add(b)
        else:
            self.pending.add(b)

    def deliver(self, ps: ParamSlots, grad: torch.Tensor, first: bool, final: bool) -> None:
        b = ps.bucket
        shape = grad.shape  # the parameter's (a paged one is an empty tensor between uses)
        if not self.cuda:
            if not first:
                self.handle.wait(b)
            ps.grad_slot.view(shape).copy_(grad)
            self.handle.ready(b, first, final)
            return
        stream = self.side_stream
        if not first:
            # The bucket's previous delivery (an earlier micro-batch) must be processed before its
            # slot is overwritten; its doorbell is rung from the stream, so drain that first.
            stream.synchronize()
            self.handle.wait(b)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            ps.grad_slot.view(shape).copy_(grad, non_blocking=True)
            grad.record_stream(stream)
            self.handle.ready_on_stream(stream.cuda_stream, b, first, final)

    def sync_master(self, ps: ParamSlots) -> None:
        if self.dp is None or self.dp.writes_masters:  # data parallel: the node's first rank writes them
            # A paged parameter's values are its parameter slot (it is an empty tensor between uses).
            ps.master.view(ps.shape).copy_(ps.param_slot.view(ps.shape) if ps.paged else ps.param.detach())
        ps.version = ps.param._version

    def restore_dtypes(self, per_bucket: dict[int, BucketState]) -> None:
        """Gives parameters that param_dtype= cast back their own dtype, with the values of their
        fp32 masters (not the rounded working copies)."""
        for b, (master, _m, _v, _step) in per_bucket.items():
            ps = self.params[b]
            p = ps.param
            if p.dtype != ps.orig_dtype:
                p.data = master.view(p.shape).to(device=p.device, dtype=ps.orig_dtype)

    def raise_async(self) -> None:
        err = self.handle.take_async_error() if self.handle is not None else None
        if err is not None:
            code, msg = err
            raise error_class(code)(msg, code)

    # ---- updates owed to the model (overlap_forward)
    def complete_update(self, b: int) -> None:
        """Waits for bucket b's update and copies its parameter slot into the parameter (H2D on the
        current stream on CUDA): the deferred half of finish_step()."""
        ps = self.params[b]
        p = ps.param
        was = self.deferred_versions.get(b)
        if was is not None and p._version != was:
            # Changed in place by the trainer after step(): the change was made to the weight before the
            # update. The change is kept (its master follows it at its next gradient), the update dropped.
            self.wait_bucket(b)
            self.deferred_versions.pop(b, None)
            self.waits.pending.pop(b, None)
            raise RuntimeError(
                f"parameter {ps.index} was modified in place after optimizer.step() while its update was still owed "
                f"(overlap_forward=True copies it in just before the parameter's next forward), so the change was "
                f"made to the weight before the update: the parameter keeps the change and this step's update of it "
                f"is dropped. Call optimizer.synchronize() before changing parameters between steps, or pass "
                f"overlap_forward=False to wrap()")
        self._take_update(b)
        self.deferred_versions.pop(b, None)

    def _take_update(self, b: int) -> None:
        """Waits for bucket b's update and copies its parameter slot into the parameter (H2D on the
        current stream on CUDA). A paged bucket's slot is its paged copy: its next use copies it."""
        ps = self.params[b]
        self.wait_bucket(b)
        if ps.paged:
            return
        p = ps.param
        with torch.no_grad():
            p.view(p.shape).copy_(ps.param_slot.view(p.shape), non_blocking=self.cuda)
        ps.version = p._version

    def wait_bucket(self, b: int) -> None:
        """Waits until tsd's update of bucket b for this step is done. Data parallel: until tsd's
        step count of the bucket reaches this rank's last step (its owner may be another rank)."""
        if self.dp is not None:
            self.handle.wait_steps(b, self.dp.expected[b])
        else:
            self.handle.wait(b)
        if self.timeline is not None:
            self.timeline.append((b, *self.handle.times(b), time.monotonic_ns()))

    def wait_updates(self, buckets: Optional[list[int]] = None) -> None:
        """Completes the updates still owed to the model: of `buckets`, or all (None). Everything that
        reads a parameter, a parameter slot or the optimizer's state between steps calls this first;
        with overlap_forward=False nothing is ever owed."""
        if self.waits.pending and self.handle is not None:
            self.waits.complete(buckets)

    def start_overlap(self, model: torch.nn.Module) -> None:
        """wrap(overlap_forward=True): records the forwards until the first step."""
        self.model = model
        self.recorder = ForwardOrder(model, {id(ps.param): ps.bucket for ps in self.params})

    def finish_recording(self, set_order: bool = True) -> None:
        """At the first step: the recorded order goes to tsd (`set_order`: data parallel, the node's
        first rank only, for the node's one optimizer) and the pre-forward waits are installed.
        Nothing recorded (no forward since wrap()): keeps recording."""
        rec = self.recorder
        if rec is None or self.model is None or not rec.first:
            return
        self.recorder = None
        order = rec.finish()
        bucket_of = {id(ps.param): ps.bucket for ps in self.params}
        modules = wait_modules(self.model, rec.first, owners_of(self.model, bucket_of), order)
        if set_order:
            self.handle.set_order(([self.norm_bucket] if self.norm_bucket is not None else []) + order)
        self.forward_order = order
        self.waits.install(self.model, modules)
        self.events.append(f"overlap_forward: {len(order)} of {len(self.params)} buckets finish during the next "
                           f"forward, in the order it uses them (through {len(modules)} modules' pre-hooks)"
                           f"{'; the others at step()' if len(order) < len(self.params) else ''}")

    # ---- the end of a step
    def finish_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.dp is not None:
            self.dp.finish_step(self, optimizer)
            return
        started = time.perf_counter()
        if self.cuda:
            self.side_stream.synchronize()  # every doorbell of this step has been rung
        self.raise_async()
        h = self.handle
        if self.recorder is not None:
            self.finish_recording()
        # Updates of the last step that this step's forward did not take (their modules did not run)
        # are completed now: nothing is owed for longer than one step.
        self.wait_updates()
        deferrable = self.waits.deferrable
        if self.pending:
            # Parameters that got fewer than accumulation_steps gradients in this step: close their
            # accumulation with a zero final delivery (adding zeros is exact).
            if self.hyper is None:
                self.write_hyper(optimizer)
            for b in sorted(self.pending):
                h.wait(b)
                self.params[b].grad_slot.zero_()
                h.ready(b, False, True)
                self.finaled.add(b)
            self.pending.clear()
        changed = None
        if self.max_grad_norm > 0:
            carried = self.share is not None and self.share.deliver_norm(self)  # the GPU share's part of the norm
            if self.finaled or carried:
                self.write_hyper(optimizer)  # the daemon reads them at the commit
                h.commit(wait=not deferrable)  # handed over: each bucket is waited for where it is needed
        elif self.hyper is not None and self.group_hyper(optimizer) != self.hyper:
            changed = (self.hyper, self.group_hyper(optimizer))
        for b in sorted(self.finaled):
            ps = self.params[b]
            if b in deferrable:
                # Its module's next forward waits for it; a paged bucket's, the pager, before it copies
                # the block from the slot (its prefetch, depth blocks ahead of the forward).
                if not ps.paged:
                    self.deferred_versions[b] = ps.param._version
                self.waits.defer(b)
                continue
            self._take_update(b)
        if self.share is not None:
            self.share.step(optimizer, self)  # on the device, clipped by the global norm
        if self.marks is not None:
            self.marks.record(self.steps + 1, self.finaled | self.skip)
        self.skip.clear()
        self.finaled.clear()
        self.counts.clear()
        self.hyper = None
        self.steps += 1
        if self.pager is not None:
            self.pager.after_step()  # a block the planner moves completes its own owed updates first
        _report.report_step(self, started)
        if changed is not None:
            raise hyper_changed(*changed)

    def idle(self) -> None:
        """Waits until no delivery is in flight (between steps) and every update is in the model."""
        if self.cuda:
            self.side_stream.synchronize()
        self.raise_async()
        self.wait_updates()
        if self.handle is not None:
            self.handle.wait_all()

    # ---- memory
    def measured_vram(self) -> tuple[Budget, int]:
        """The budget wrap() was given, its missing fields measured now, and the VRAM peak the steps
        so far reached: torch's since the process started or the last reset, and with a weight pager
        the largest its block planner saw (it resets torch's peak after each step it refines). On a
        CPU device the peak is 0. What the decisions after a measured step (activation paging,
        offload="auto"'s switch, optimizer_gpu_fraction="auto") compare."""
        budget = self.budget.merged(planner.measure_device(self.device))
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        if self.pager is not None:
            peak = max(peak, self.pager.highest_peak)
        return budget, peak

    # ---- state
    def read_state(self, buckets: Optional[list[int]] = None) -> dict[int, BucketState]:
        """{bucket: (master, exp_avg, exp_avg_sq, step)} from the daemon, of `buckets` (ascending),
        or of every bucket it updates (None: not those moved to the GPU share), as flat tensors:
        views of a file-backed snapshot (`_state.read`), not copies on the heap; with `buckets`
        the daemon writes only those it returns (all of them: an empty list). (Writing state back is
        `TsdAdamW.load_state_dict`, one tensor at a time, and `TsdAdamW.load_state`.)"""
        self.idle()
        wanted = [b for b in range(len(self.params)) if b not in self.moved] if buckets is None else list(buckets)
        fd = _state.new_file()
        try:
            self.handle.save_state(fd, wanted if buckets is not None or self.moved else [])
            tensors, _ = _state.read(fd)
        finally:
            os.close(fd)
        return _state.bucket_states(tensors, wanted)

    def release(self, keep_pager: bool = False) -> None:
        """Removes the hooks and gives the job's memory back (when this session owns the client).
        `keep_pager`: activation paging stays on (the switch to stock AdamW: the VRAM it measured
        was with paging), its pages from torch's pinned memory from then on (the job is released)."""
        for ps in self.params:
            if ps.hook is not None:
                ps.hook.remove()
                ps.hook = None
        if self.recorder is not None:
            self.recorder.finish()
            self.recorder = None
        self.waits.remove()
        self.waits.pending.clear()  # callers that keep the values (unwrap, the switch) were idle() first
        if self.head_check is not None:
            self.head_check.remove()
            self.head_check = None
        if self.pager is not None:
            self.pager.close()  # the weights come back before the slots go (unwrap() closed it already)
            self.pager = None
        if self.act_pager is not None:
            if keep_pager:
                self.act_pager.host = PinnedHost(pin=self.cuda)
            else:
                self.act_pager.remove()
                self.act_pager = None
        if self.recompute is not None and not keep_pager:  # the switch keeps it, as the pages: the peak had it
            self.recompute.remove()
            self.recompute = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.offloading = False
        for ps in self.params:
            ps.master = ps.grad_slot = ps.param_slot = None
        self.norm_slot = None
        self.handle = None
        self.segments.restore()
        if self.owns_client and self.client is not None:
            try:
                self.client.close()
            except TsdError:
                pass  # the daemon is gone; so is the job
        self.client = None


