"""`TsdAdamW`: the `torch.optim.Optimizer` that `wrap()` returns, a facade over the session's
daemon-side AdamW, and the switch of `offload="auto"` to stock AdamW when it fits."""
from __future__ import annotations

import collections
import os
import time
from typing import IO, Any, Callable, Optional, Union

import torch

from . import _state, activation_auto, gpushare, planner, share_auto
from ._state_checks import check_state_dict
from .allocator import budget_binds
from .engine import ParamSlots, Session
from .errors import MemoryCheckFailed, Refusal, TsdError
from .paging.activations import ActivationProfiler, page_blocks, trim_pages_host
from .paging.recompute import recompute_blocks
from .progress import Progress

# A file the optimizer's state streams to or from: a descriptor, or an object with fileno().
StateFile = Union[int, IO[Any]]


class TsdAdamW(torch.optim.Optimizer):
    """The optimizer `wrap()` returns: torch.optim.AdamW's interface, with the update done by tsd.

    `param_groups` is live (LR schedulers edit it); `state_dict()` reads the state from the daemon
    in torch.optim.AdamW's layout (plus each parameter's fp32 "master"), as views of a file-backed
    snapshot; `load_state_dict()` writes it back one tensor at a time. `save_state(file)` and
    in the trainer's memory. The parameters of the GPU share (`optimizer_gpu_fraction`,
    gpushare.py) are updated by torch's AdamW on the device, their state in this process (`state`
    is that AdamW's); after `offload="auto"` switched to stock AdamW, the share holds them all."""

    def __init__(self, original: torch.optim.Optimizer, session: Session, moment_dtype: str) -> None:
        self._session = session
        self.moment_dtype = moment_dtype
        super().__init__(original.param_groups, original.defaults)
        self._share_state()

    def _share_state(self) -> None:
        """`state` is the GPU share's (torch's AdamW over its masters); tsd's lives in the daemon."""
        share = self._session.share
        if share is not None and share.inner is not None:
            self.state = share.inner.state

    @property
    def offloading(self) -> bool:
        """Whether tsd updates any of the parameters (False: optimizer_gpu_fraction=1, or after
        offload="auto" switched to stock AdamW on the device)."""
        return self._session.offloading

    def _check(self):
        s = self._session
        if s.closed:
            if s.failure is not None:  # the daemon ended the session: the same error, every time
                raise type(s.failure)(s.failure.message, s.failure.code)
            raise TsdError("this optimizer's model was unwrapped; wrap it again to train it")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check()
        s = self._session
        if not s.offloading:  # everything in the GPU share: torch's AdamW on the device
            s.share.step(self, s)
            s.steps += 1
        else:
            t0 = time.perf_counter()
            try:
                s.finish_step(self)
            except TsdError as e:
                s.fail(e)
                raise
            s.step_times.append(time.perf_counter() - t0)
        if s.steps == 1 and isinstance(s.act_pager, ActivationProfiler):
            decide_activation_offload(s)
        elif s.steps == 1 and s.act_pager is not None and s.arena is not None:
            # A fixed activation_offload (True or a share): the pages its first step took count
            # against the host RAM as "auto"'s do.
            check_activation_host(s, s.arena.capacity_bytes)
        if s.act_refine is not None:
            activation_auto.maybe_refine(s)  # activation_offload="auto": the pages the settled plan has room for
        if s.offload == "auto" and s.steps >= 2 and s.offloading:
            maybe_switch_to_stock(self)  # decides once: offload becomes True, or the GPU share takes everything
        if s.auto_share is not None:
            share_auto.maybe_decide(self)  # optimizer_gpu_fraction="auto", from a measured step
        return loss

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global norm of the last step's gradients before clipping, as tsd computed it to clip
        them (what torch.nn.utils.clip_grad_norm_ returns). None without max_grad_norm (no norm is
        computed), and before the first step. With everything on the device (optimizer_gpu_fraction=1,
        or after offload="auto" switched), torch's clip_grad_norm_ over the GPU share computes it."""
        s = self._session
        if s.max_grad_norm <= 0 or s.steps == 0:
            return None
        if not s.offloading:
            return s.share.last_norm if s.share is not None else None
        if s.handle is None:
            return None
        s.handle.wait_committed()  # overlap_forward: step() returned once the commit was handed over
        return float(s.handle.last_grad_norm)

    def synchronize(self) -> None:
        """Waits until the daemon has applied every delivered update and (overlap_forward) every
        update is copied into the model: call it before changing parameters between steps."""
        if self._session.offloading:
            self._session.idle()

    # ---- state
    def _index(self):
        """Parameters in state_dict order (param_groups order), with their indices."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout. Offloaded, the tensors are views of a snapshot the daemon
        wrote into an unlinked temporary file ($TRAINSTREAM_STATE_DIR, else the system's temporary
        directory), mapped privately: they are not copied onto the trainer's heap, their pages are
        the file's page cache, and they stay valid (the state at this call) after further steps and
        after unwrap(), until the last of them is dropped; writing into one copies just its pages."""
        self._check()
        shared, self.state = self.state, collections.defaultdict(dict)  # the GPU share's is keyed by its masters
        try:
            sd = super().state_dict()  # the param_groups; the state follows
        finally:
            self.state = shared
        s = self._session
        per_bucket: dict[int, Any] = {}
        if s.offloading:
            with Progress("state_dict", state_file_bytes(s), "bytes", counted=False):
                per_bucket = s.read_state()  # the daemon writes the snapshot in one call
        index = {id(p): i for i, p in enumerate(self._index())}
        state = {}
        if s.share is not None:  # the GPU share's, torch's own tensors
            for e in s.share.entries:
                st = s.share.state_of(e.param)
                if st is not None:
                    state[index[id(e.param)]] = st
        for b, st in per_bucket.items():
            if st[3] == 0:
                continue  # torch keeps no state for a parameter never stepped
            ps = s.params[b]
            state[index[id(ps.param)]] = torch_state(st, ps.shape)  # a paged parameter is empty between uses
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_missing: bool = False) -> None:
        """Writes a state_dict (this optimizer's, or torch.optim.AdamW's) into tsd. The file the
        daemon reads is filled one tensor at a time, each converted as it is written. A saved
        "master" is used only where it rounds to the model's parameter (it adds precision below
        a bf16/fp16 parameter, never other values); otherwise the parameter is the truth.

        Everything is checked before anything is written (`_state_checks`): a non-finite value,
        a negative `exp_avg_sq`, a negative or fractional `step`, or a trainable parameter
        without state while others have some is refused with a ValueError naming the parameter,
        and nothing changes. `allow_missing=True` loads parameters without state as never
        stepped (torch keeps no state for a parameter that never got a gradient). Under data
        parallel (`distributed=`) every rank calls it, with the same state: the node's first rank
        loads it into the node's one optimizer and the others wait for it."""
        self._check()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state_dict's param_groups do not match this optimizer's (number of groups or "
                             "parameters per group)")
        s = self._session
        params = self._index()
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        # Sizes from the slots' shapes: a paged parameter is an empty tensor between uses.
        share = s.share.by_param if s.share is not None else {}
        check_state_dict(saved_state, [(i, s.by_param[id(p)].shape.numel() if id(p) in s.by_param else p.numel(),
                                        s.param_names.get(id(p), f"parameter {i}"))
                                       for i, p in enumerate(params) if id(p) in s.by_param or id(p) in share],
                         allow_missing)
        mdt = torch.float32 if self.moment_dtype == "float32" else torch.bfloat16
        e = _state.entry
        entries: dict[str, Any] = {}
        on_device: list[tuple[torch.Tensor, Optional[dict[str, Any]]]] = []  # the GPU share's
        for i, p in enumerate(params):
            if id(p) in share:
                st = saved_state.get(i)
                if st is not None and any(k not in st or st[k].numel() != p.numel() for k in ("exp_avg", "exp_avg_sq")):
                    raise ValueError(f"the state_dict's state[{i}] does not match parameter {i} ({p.numel()} elements): "
                                     f"exp_avg or exp_avg_sq missing or of another size")
                if st is not None and "step" not in st:
                    raise ValueError(f"the state_dict's state[{i}] has no step")
                on_device.append((p, st))
                continue
            ps = s.by_param.get(id(p)) if s.offloading else None
            if ps is None:
                continue  # frozen: not in the daemon
            st = saved_state.get(i)
            n, b = ps.shape.numel(), ps.bucket
            if st is not None:
                bad = [k for k in ("exp_avg", "exp_avg_sq") if k not in st or st[k].numel() != n]
                if bad or "step" not in st:
                    raise ValueError(f"the state_dict's state[{i}] does not match parameter {i} ({n} elements): "
                                     f"{bad or ['step']} missing or of another size")
            step = 0 if st is None else st["step"]
            step = int(step.item() if torch.is_tensor(step) else step)
            work = _working_copy(ps)
            entries[e(b, "master")] = (torch.float32, (n,), lambda work=work, st=st: _master_for(work, st))
            for part in ("exp_avg", "exp_avg_sq"):
                entries[e(b, part)] = (mdt, (n,), lambda st=st, part=part, n=n: _moment(st, part, n, mdt))
            entries[e(b, "step")] = torch.tensor([step], dtype=torch.int64)
        # Buckets with nothing to keep: those "auto" moved to the GPU share (share_auto.py; tsd's
        # slots are unused) and the norm bucket (gpushare.py).
        unused = [(b, s.params[b].shape.numel()) for b in sorted(s.moved)]
        if s.norm_bucket is not None:
            unused.append((s.norm_bucket, 1))
        for b, n in unused:
            entries[e(b, "master")] = torch.zeros(n, dtype=torch.float32)
            entries[e(b, "exp_avg")] = torch.zeros(n, dtype=mdt)
            entries[e(b, "exp_avg_sq")] = torch.zeros(n, dtype=mdt)
            entries[e(b, "step")] = torch.tensor([0], dtype=torch.int64)
        if s.offloading:
            meta = {"format": _state.FORMAT, "buckets": str(len(entries) // 4),
                    "moment_dtype": _state.MOMENT_TAGS[self.moment_dtype], "committed": "0"}
            s.idle()

            def load() -> None:
                fd = _state.new_file()
                try:
                    with Progress("load_state_dict", state_file_bytes(s), "bytes", poll=lambda: os.fstat(fd).st_size):
                        _state.write(fd, entries, meta)  # the file is sized first: the line shows the whole at once
                        s.handle.load_state(fd)
                finally:
                    os.close(fd)

            if s.dp is not None:
                s.dp.load_state(s, load)  # every rank calls it; the node's first rank loads the node's optimizer
            else:
                load()
        for p, st in on_device:  # the GPU share's, once tsd took its part
            s.share.load(p, _master_for(p, st), st)
        for saved, mine in zip(groups, self.param_groups):  # once the daemon took the state
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        for ps in s.params:
            ps.version = ps.param._version

    # ---- streaming
    def save_state(self, file: StateFile) -> int:
        """Streams the optimizer's state (fp32 masters, moments, step counts; safetensors, format
        "tsd.optimizer.v1") into `file`, a regular file the trainer opened for writing (a
        descriptor or an object with fileno()): the daemon writes it directly, so nothing of it
        passes through the trainer's memory. The file is truncated and written from offset 0; its
        position is left where it was. Returns the bytes written. The hyperparameters are not in
        it: keep `state_dict()["param_groups"]` (or the schedule) beside it. Call between steps."""
        self._check_streaming("save_state")
        fd = _descriptor(file)
        self._session.idle()
        with Progress("save_state", state_file_bytes(self._session), "bytes", poll=lambda: os.fstat(fd).st_size):
            return int(self._session.handle.save_state(fd))

    def load_state(self, file: StateFile) -> None:
        """Restores state written by `save_state` from `file` (a regular file opened for reading)
        into tsd; the daemon reads it directly and checks it against this optimizer's layout (the
        same parameters, in the same order, with the same moment dtype) before changing anything.
        A loaded master is kept only where it rounds to the model's parameter (as with
        `load_state_dict`); elsewhere it is taken from the parameter, compared chunk by chunk
        within `planner.STREAM_BUFFER`. Call between steps. Under data parallel (`distributed=`)
        every rank calls it: the node's first rank loads the node's one optimizer, the others wait."""
        self._check_streaming("load_state")
        fd = _descriptor(file)
        s = self._session
        s.idle()

        def load() -> None:
            with Progress("load_state", len(s.params)) as bar:
                s.handle.load_state(fd)
                for ps in s.params:
                    if not _master_rounds_to_param(ps):
                        s.sync_master(ps)
                    bar.advance()

        if s.dp is not None:
            s.dp.load_state(s, load)  # every rank calls it; the node's first rank loads the node's optimizer
        else:
            load()
        for ps in s.params:
            ps.version = ps.param._version

    def _check_streaming(self, what: str) -> None:
        self._check()  # unwrapped or ended by tsd: that error first
        if not self.offloading:
            raise RuntimeError(f"{what}: this optimizer's state is all in torch on the device (offload='auto' switched "
                               f"to stock AdamW, or optimizer_gpu_fraction=1); use state_dict() / load_state_dict()")
        if self._session.share is not None:
            raise RuntimeError(f"{what}: the GPU share's state (optimizer_gpu_fraction) is in torch on the device, not "
                               f"in tsd; use state_dict() / load_state_dict()")

    def __repr__(self) -> str:
        share = self._session.share
        mode = "offloaded to tsd" if self.offloading else "torch's AdamW on the device"
        if share is not None and self.offloading:
            mode += f", {len(share)} tensors on the device"
        return f"TsdAdamW({mode}, {len(self.param_groups)} groups, moments {self.moment_dtype})"


def state_file_bytes(session: Session) -> int:
    """The tensor bytes of the session's state file (masters, moments, steps; its small header
    aside): what save_state() writes."""
    moment = 4 if session.moment_dtype == "float32" else 2
    return sum(_numel(ps.shape) * (4 + 2 * moment) + 8 for ps in session.params)


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _descriptor(file: StateFile) -> int:
    if isinstance(file, int) and not isinstance(file, bool):
        fd = file
    else:
        flush = getattr(file, "flush", None)
        if callable(flush):
            flush()  # what Python buffered for it, before the daemon writes at its offsets
        fileno = getattr(file, "fileno", None)
        if not callable(fileno):
            raise TypeError(f"expected a file descriptor or an open file, not {type(file).__name__}")
        fd = int(fileno())
    if fd < 0:
        raise ValueError(f"{fd} is not an open file descriptor")
    return fd


def _master_for(p: torch.Tensor, st: Optional[dict[str, Any]]) -> torch.Tensor:
    """The fp32 master to load for `p`: the saved one where it rounds to `p`, else `p` upcast."""
    flat = p.detach().reshape(-1)
    master = None if st is None else st.get("master")
    if master is not None:
        master = master.detach().reshape(-1)
        if master.numel() == flat.numel() and torch.equal(master.to(p.dtype).cpu(), flat.cpu()):
            return master.to("cpu", torch.float32).contiguous()
    return flat.to("cpu", torch.float32).contiguous()


def _moment(st: Optional[dict[str, Any]], part: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    if st is None:
        return torch.zeros(n, dtype=dtype)
    return st[part].detach().reshape(-1).to("cpu", dtype).contiguous()


def _working_copy(ps: ParamSlots) -> torch.Tensor:
    """The parameter's values as the model uses them: a paged parameter's are its parameter slot
    (tsd memory; the parameter is an empty tensor between uses)."""
    return ps.param_slot.view(ps.shape) if ps.paged else ps.param.detach()


def _master_rounds_to_param(ps: ParamSlots) -> bool:
    """Whether the bucket's fp32 master (tsd memory, mapped) rounds to its parameter, compared in
    chunks of at most planner.STREAM_BUFFER bytes of host memory."""
    p = _working_copy(ps).reshape(-1)
    master = ps.master
    chunk = max(1, planner.STREAM_BUFFER // 8)
    for i in range(0, p.numel(), chunk):
        if not torch.equal(master[i:i + chunk].to(p.dtype), p[i:i + chunk].cpu()):
            return False
    return True


def torch_state(st: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], shape: torch.Size) -> dict[str, Any]:
    """One bucket's (master, exp_avg, exp_avg_sq, step) in torch.optim.AdamW's layout, as views of
    `shape` (plus tsd's "master")."""
    master, m, v, step = st
    return {"step": torch.tensor(float(step)), "exp_avg": m.view(shape), "exp_avg_sq": v.view(shape),
            "master": master.view(shape)}


def decide_activation_offload(session: Session) -> None:
    """activation_offload="auto", after the first step: from the step's VRAM peak and the bytes
    each block saved (the profiler's), pages the activations of the blocks needed to fit the
    usable VRAM, within what tsd can still lend the job (planner.activations_to_page), or none;
    the profiler goes either way. The peak is torch's since the process started or the caller's
    last torch.cuda.reset_peak_memory_stats(), or, with param_offload="auto", the first step's as
    the block planner measured it (it resets torch's peak at wrap() and after each step it refines)."""
    prof = session.act_pager
    assert isinstance(prof, ActivationProfiler)
    prof.remove()
    session.act_pager = None
    if prof.paging and prof.started_at is None:
        # The first step paged every block's activations beside every block's weights: the peak the
        # weight planner refines from was measured so. Keeping them paged keeps that measurement true
        # (moving them back while the planner moves weights in could overrun the budget at once).
        chosen = [i for i, n in enumerate(prof.block_bytes) if n > 0] or list(range(len(prof.blocks)))
        why = ("activation_offload=auto after the first step: it paged them beside every block's weights to fit a "
               "tight budget, and they stay off the device so that the weight planner's measured peak holds; once "
               "its plan settles, those the peak has room for come back")
        if recompute_first(session, prof, chosen, why):
            return
        page_blocks(session, prof.model, prof.name, prof.blocks, chosen, why=f" ({why})", min_bytes=prof.min_bytes)
        refine_later(session, prof, chosen)
        check_activation_host(session, session.arena.capacity_bytes if session.arena is not None else 0)
        return
    budget, peak = session.measured_vram()
    room = None
    if session.cuda and session.client is not None:
        try:
            c = session.client
            room = planner.tsd_budget(c.status(), c.jobs(), c.job, 0).tsd_available
        except TsdError:
            room = None  # the daemon's answer is missing: the arena's own error tells if it cannot lend
    usable = budget.vram_usable if session.cuda else None
    excess = None
    if prof.started_at is not None:
        # Paging started by itself at that block (the step would have passed the VRAM budget).
        paged = sum(prof.block_bytes[prof.started_at:])
        session.events.append(f"activation_offload=auto: the first step paged blocks {prof.started_at}-"
                              f"{len(prof.blocks) - 1} by itself ({planner.format_bytes(paged)}), from the block "
                              f"where it would have passed {planner.format_bytes(prof.limit or 0)} of VRAM")
        if prof.limit is not None and usable is not None:
            usable = min(usable, prof.limit)
        if session.planner is not None and session.pager is not None and usable is not None:
            # The weight planner refines from this step's peak, measured with those bytes off the
            # device: page as many (the first blocks', made first and needed last) so that the
            # measurement holds, and let it answer for any excess. Covering the excess here too
            # answers it twice: measured on the H100 under a 12 GiB cap, a 0.5 GiB excess paged ten
            # blocks' weights and every block's activations.
            excess = paged
        else:
            peak += paged  # the decision is made for the unpaged peak, to the first step's target
    chosen, why = planner.activations_to_page(peak, usable, prof.block_bytes, room, excess=excess)
    per_block = ", ".join(planner.format_bytes(n) for n in prof.block_bytes)
    if not chosen:
        session.events.append(f"activation_offload=auto: nothing paged ({why}; saved activations per block: "
                              f"{per_block})")
        trim_pages_host(session, 0, "the first step's pages are not needed")
        return
    if recompute_first(session, prof, chosen, f"activation_offload=auto after the first step: {why}"):
        return
    page_blocks(session, prof.model, prof.name, prof.blocks, chosen,
                why=f" (activation_offload=auto after the first step: {why})", min_bytes=prof.min_bytes)
    refine_later(session, prof, chosen)
    recut_segments(session, f"activations of {len(chosen)} blocks are paged to fit the budget")
    check_activation_host(session, sum(prof.block_bytes[i] for i in chosen))
    trim_pages_host(session, session.activation_host_bytes, "fewer blocks paged than the first step did")


def recompute_first(session: Session, prof: ActivationProfiler, chosen: list[int], why: str) -> bool:
    """activation_recompute="auto": the blocks the first decision takes off the device (`chosen`)
    are recomputed in backward from the next step on rather than paged, unless one of them updates
    state in its forward (activation_auto.stateful). Returns whether it did; else the caller pages
    them. Deciding this after the first step, not once the memory plan settles, spares the run a
    second layout: measured on the H100 (Qwen2.5-1.5B, 8x512, 12 GiB), paging first and recomputing
    after the weight plan settled moved the peak under that settled plan, and its watchdog paged one
    more block per step four times inside the measured window. The weight planner, still refining,
    measures the recompute's peak from the start; the refinement later stops recomputing the last
    blocks the settled peak has room for (activation_auto.maybe_refine)."""
    if not getattr(session, "recompute_auto", False):
        return False
    stateful = activation_auto.stateful(prof.blocks, chosen)
    if stateful:
        session.events.append(f"activation_recompute=auto: the blocks are paged, not recomputed: {stateful}")
        return False
    recompute_blocks(session, prof.blocks, chosen, why=f" (activation_recompute=auto: instead of paging them; {why})")
    refine_later(session, prof, chosen, recomputing=True)
    recut_segments(session, f"activations of {len(chosen)} blocks are recomputed to fit the budget")
    check_activation_host(session, 0)
    trim_pages_host(session, 0, "the blocks the first step paged are recomputed instead")
    return True


def recut_segments(session: Session, reason: str) -> None:
    """After the first decision changed what the steps keep on the device (`reason`): the first
    step's cached segments were cut for its own pattern (nothing, or other blocks, paged); kept,
    they fragment the next steps' under a cap. Measured on the H100 (1.5B, 16 GiB cap): step 2 ran
    out of VRAM with 10.1 GiB allocated and 4.0 GiB cached unused. From now on, segments that grow
    (allocator.py), unless the user chose otherwise; the cache is emptied. Nothing on the CPU."""
    if session.cuda:
        budget_binds(session, reason)
        torch.cuda.empty_cache()


def refine_later(session: Session, prof: ActivationProfiler, chosen: list[int], recomputing: bool = False) -> None:
    """Leaves the blocks just chosen (paged, or `recomputing`) for activation_auto.maybe_refine,
    which brings back those the settled plan's measured peak has room for; torch's peak restarts so
    that the next step measures them (the weight planner resets it too, after each step it refines)."""
    session.act_refine = activation_auto.Refine(
        prof.model, prof.name, list(prof.blocks), list(chosen), list(prof.block_bytes), prof.min_bytes,
        session.act_pager, session.steps, recomputing)
    activation_auto.changed(session)


def check_activation_host(session: Session, nbytes: int) -> None:
    """check_memory's second half, after the first step: the activation pages it chose (`nbytes`,
    lent by tsd from the node's RAM) on top of the host memory wrap() counted (`Plan.host_bytes`)
    must stay within what wrap() found this process may take (`Plan.host_room`). Records them in
    `session.activation_host_bytes`; raises MemoryCheckFailed naming each part when they do not
    fit (the step that measured them has completed: the model and optimizer state are intact)."""
    session.activation_host_bytes = int(nbytes)
    plan = session.memory_plan
    if plan is None or plan.host_room is None or not session.check_memory:
        return
    need = plan.host_bytes + session.activation_host_bytes
    if need <= plan.host_room:
        return
    fmt = planner.format_bytes
    message = (f"the node's host RAM cannot hold this run's activation pages: the first step paged "
               f"{fmt(session.activation_host_bytes)} of saved activations, on top of the {fmt(plan.host_bytes)} wrap() "
               f"counted (tsd's regions and the client's own needs), {fmt(need)} of the {fmt(plan.host_room)} this "
               f"process may take. Lower the batch or the sequence length, use gradient checkpointing, or free host "
               f"memory; wrap(check_memory=False) skips this check")
    raise MemoryCheckFailed(message, [Refusal("host", need, plan.host_room, message)])


def stock_adamw_fits(session: Session) -> tuple[bool, str]:
    """Whether moving tsd's share onto the device fits next to what the first steps used: the
    measured peak (with any GPU share already in it) plus what the share keeps per parameter
    (planner.stock_adamw_extra_bytes), against the usable VRAM of the session's budget (measured
    now where wrap() was given none). On a CPU device there is no VRAM to save: offloading stays,
    unless a budget passed to wrap() gives one. Returns (fits, explanation)."""
    budget, peak = session.measured_vram()
    extra = planner.stock_adamw_extra_bytes(
        (ps.param.numel(), ps.param.element_size(), ps.orig_dtype.itemsize) for ps in session.params
        if ps.bucket not in session.moved)
    return planner.stock_adamw_fits(peak, extra, budget.vram_usable)


def maybe_switch_to_stock(opt: "TsdAdamW") -> None:
    """offload="auto", after the second step: when it fits (see stock_adamw_fits), the GPU share
    (gpushare.py) takes every parameter tsd holds, with its state, as optimizer_gpu_fraction=1
    would have from the start, and the job is released. Parameters cast by param_dtype= get
    their own dtype back first (their fp32 masters' values), so torch's AdamW steps the model as
    the user made it.

    With param_offload="auto" the decision waits until the block planner's plan settled: settled
    with blocks paged, offloading stays (their parameter slots in tsd are their only copy);
    settled with nothing paged, it is decided as if there were no pager, and a switch releases the
    pager (no hook, plain parameters on the device). It waits for activation_offload="auto"'s
    refinement too, and for a step measured after it changed anything (activation_auto.py). Once
    decided, `s.offload` is True or the share holds everything, so it is decided once."""
    s = opt._session
    if not activation_auto.settled(s):
        return  # activation_offload="auto" refines its pages first, then a step measures them
    pager = s.pager
    if pager is not None:
        if pager.auto and s.planner is not None and not s.planner.done:
            if s.steps == 2:
                s.events.append("offload=auto: decides once the memory plan settled (param_offload='auto')")
            return
        if pager.paged or not pager.auto:
            s.offload = True
            s.events.append(f"offload=auto: keeps offloading (the weights of {len(pager.paged)} of {len(pager.blocks)} "
                            f"blocks are paged from tsd's memory, their parameter slots)")
            return
    fits, why = stock_adamw_fits(s)
    if not fits:
        s.offload = True
        s.events.append(f"offload=auto: keeps offloading ({why})")
        return
    switch_to_device(opt, f"offload=auto: switched to stock {'fused ' if s.cuda else ''}AdamW on {s.device} ({why})")


def switch_to_device(opt: "TsdAdamW", why: str) -> None:
    """The GPU share takes every parameter tsd holds, with its state, and the job is released:
    offload="auto"'s switch, and optimizer_gpu_fraction="auto" when everything fits (share_auto).
    Parameters cast by param_dtype= get their own dtype back first (their fp32 masters' values).
    `why` starts the event line."""
    s = opt._session
    pager = s.pager
    s.auto_share = None  # decided: everything
    per_bucket = s.read_state()
    s.restore_dtypes(per_bucket)  # the model's own dtype: an fp32 parameter is its own master
    if s.share is None:
        s.share = gpushare.GpuShare(s.device, len(opt.param_groups))
    items = [(s.params[b].param, s.params[b].group, s.params[b].index, master, m, v, step)
             for b, (master, m, v, step) in per_bucket.items()]
    # The fit check measured the peak with the activations paged: their pager stays. The weight
    # pager (param_offload="auto", nothing paged) goes, with its hooks and its planner.
    s.release(keep_pager=True)
    s.planner = None
    s.share.adopt(items, opt.param_groups)
    s.share.hook_gradients()
    opt._share_state()
    s.norm_bucket = s.norm_slot = None
    s.events.append(f"{why}; the job's memory in tsd was released"
                    f"{'; the weight pager (nothing paged) was released' if pager is not None else ''}")
