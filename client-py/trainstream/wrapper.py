"""`trainstream.wrap()`: AdamW in tsd, with gradients streamed out while backward runs.

How a step flows (docs/python.md has the user's view):

* `wrap()` registers every trainable parameter with the daemon as its own bucket, in reverse
  order of registration (last layers first: backward produces them first). One bucket per tensor
  keeps torch's semantics exactly: a parameter that gets no gradient in a step is not delivered,
  so its moments and step count stay untouched, as in torch.optim.AdamW; and the daemon still
  splits large tensors across its threads. The fp32 master weights are initialised from the
  parameters.
* Backward: a post-accumulate-grad hook copies each gradient into its bucket's grad slot (on
  CUDA: D2H on a side stream into the pinned slot, and the doorbell is rung from that stream once
  the copy is done), rings the bucket's doorbell, and frees the gradient. The daemon updates the
  bucket while backward goes on.
* `step()`: waits for the buckets (with `max_grad_norm`, commits the step first: the daemon
  clips by the global norm) and copies the updated parameters back into the model (H2D on CUDA).

Hyperparameters come from `param_groups` (so LR schedulers work). Without clipping, updates run
during backward, so the values are taken at the step's first gradient; `step()` checks that
they did not change in between. With clipping, they are written at `step()`.
"""
from __future__ import annotations

import itertools
import math
import os
import socket
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import torch

from . import _state
from .activations import ActivationPager, choose_blocks, find_blocks
from .client import Client, parse_bytes
from .errors import InvalidRequest, QuotaExceeded, TsdError, error_class

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MOMENT_DTYPES = {"float32": "float32", "fp32": "float32", torch.float32: "float32",
                  "bfloat16": "bfloat16", "bf16": "bfloat16", torch.bfloat16: "bfloat16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, torch.float16: torch.float16,
                 "float32": torch.float32, "fp32": torch.float32, torch.float32: torch.float32}
_jobs = itertools.count()
_PAGE = 4096
# How much of the GPU's memory a run may plan to use (the rest is the allocator's slack).
VRAM_HEADROOM = 0.9


def _page(n):
    return max(_PAGE, -(-n // _PAGE) * _PAGE)


def _align64(n):
    return -(-n // 64) * 64


def optimizer_bytes(numels, dtypes, groups, moment_dtype, accumulate):
    """Bytes the daemon charges for an optimizer registration (its regions, page-rounded): the
    same arithmetic as daemon/optimizer/job_optimizer.cc's Plan."""
    msize = _DTYPE_BYTES[moment_dtype]
    master = sum(_align64(4 * n) for n in numels)
    moments = sum(_align64(msize * n) for n in numels)
    slots = sum(_align64(_DTYPE_BYTES[d] * n) for n, d in zip(numels, dtypes))
    control = 576 + 64 * groups + 64 * len(numels)
    total = _page(control) + _page(master) + 2 * _page(moments) + 2 * _page(slots)
    return total + (_page(master) if accumulate else 0)


def _fmt(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class _Param:
    """One trainable parameter: its bucket and the tensors aliasing the bucket's slots."""

    __slots__ = ("param", "bucket", "group", "index", "master", "grad_slot", "param_slot", "version", "hook",
                 "orig_dtype")

    def __init__(self, param, bucket, group, index):
        self.param, self.bucket, self.group, self.index = param, bucket, group, index
        self.master = self.grad_slot = self.param_slot = self.hook = None
        self.version = -1
        self.orig_dtype = param.dtype  # before param_dtype= cast it (restored by unwrap / the switch to stock)


class Session:
    """One wrapped model's link to tsd: the client, the registered optimizer, the hooks and the
    per-step bookkeeping. `unwrap_session(model)` returns it."""

    def __init__(self, device, client, owns_client, options):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.client = client
        self.owns_client = owns_client
        self.max_grad_norm = float(options["max_grad_norm"] or 0.0)
        self.accumulation_steps = int(options["accumulation_steps"])
        self.offload = options["offload"]
        self.param_dtype = options.get("param_dtype")
        self.pager: Optional[ActivationPager] = None  # with activation_offload=
        self.moment_dtype = "float32"  # set by wrap()
        self.state_bytes = 0
        self.events = []  # human-readable decisions, for logs and tests
        self.handle = None
        self.params = []      # _Param, by bucket
        self.by_param = {}    # id(param) -> _Param
        self.closed = False
        self.offloading = True
        # Per-step state.
        self.counts = {}          # bucket -> gradients delivered in this step
        self.pending = set()      # buckets with non-final deliveries in this step
        self.finaled = set()      # buckets with a final delivery in this step
        self.hyper = None         # hyperparameters written for this step, per group
        self.steps = 0            # optimizer steps applied
        self.step_times = []
        self.side_stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    # ---- hyperparameters
    def group_hyper(self, optimizer):
        out = []
        for g in optimizer.param_groups:
            b1, b2 = g["betas"]
            out.append(tuple(float(x) for x in (g["lr"], b1, b2, g["eps"], g["weight_decay"])))
        return out

    def write_hyper(self, optimizer):
        self.hyper = self.group_hyper(optimizer)
        for gi, h in enumerate(self.hyper):
            self.handle.set_group(gi, *h)

    # ---- the gradient hook
    def on_grad(self, optimizer, p):
        grad = p.grad
        if grad is None or not self.offloading:
            return
        if self.closed:
            raise TsdError("this model was unwrapped (or its optimizer failed); wrap it again to train it")
        ps = self.by_param[id(p)]
        b = ps.bucket
        n = self.counts.get(b, 0) + 1
        if b in self.finaled:
            raise RuntimeError(
                f"parameter {ps.index} received gradient number {n} before optimizer.step(), with "
                f"accumulation_steps={self.accumulation_steps}: tsd already took its last gradient of this step. For "
                f"gradient accumulation over N backward passes per step() pass accumulation_steps=N to trainstream.wrap()")
        final = n == self.accumulation_steps
        first = n == 1
        if first and p._version != ps.version:
            self.sync_master(ps)  # the parameter was changed outside the optimizer (e.g. load_state_dict)
        if final and self.hyper is None:
            self.write_hyper(optimizer)
        self.deliver(ps, grad, first, final)
        p.grad = None
        self.counts[b] = n
        if final:
            self.pending.discard(b)
            self.finaled.add(b)
        else:
            self.pending.add(b)

    def deliver(self, ps, grad, first, final):
        b = ps.bucket
        shape = ps.param.shape
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

    def sync_master(self, ps):
        ps.master.view(ps.param.shape).copy_(ps.param.detach())
        ps.version = ps.param._version

    def restore_dtypes(self, per_bucket):
        """Gives parameters that param_dtype= cast back their own dtype, with the values of their
        fp32 masters (not the rounded working copies)."""
        for b, (master, _m, _v, _step) in per_bucket.items():
            ps = self.params[b]
            p = ps.param
            if p.dtype != ps.orig_dtype:
                p.data = master.view(p.shape).to(device=p.device, dtype=ps.orig_dtype)

    def raise_async(self):
        err = self.handle.take_async_error() if self.handle is not None else None
        if err is not None:
            code, msg = err
            raise error_class(code)(msg, code)

    # ---- the end of a step
    def finish_step(self, optimizer):
        if self.cuda:
            self.side_stream.synchronize()  # every doorbell of this step has been rung
        self.raise_async()
        h = self.handle
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
            if self.finaled:
                self.write_hyper(optimizer)  # the daemon reads them at the commit
                h.commit()
        elif self.hyper is not None and self.group_hyper(optimizer) != self.hyper:
            changed = (self.hyper, self.group_hyper(optimizer))
        for b in sorted(self.finaled):
            ps = self.params[b]
            h.wait(b)
            p = ps.param
            with torch.no_grad():
                p.view(p.shape).copy_(ps.param_slot.view(p.shape), non_blocking=self.cuda)
            ps.version = p._version
        self.finaled.clear()
        self.counts.clear()
        self.hyper = None
        self.steps += 1
        if changed is not None:
            was, now = changed
            g = next(i for i, (a, c) in enumerate(zip(was, now)) if a != c)
            raise RuntimeError(
                f"param_groups[{g}] changed between backward and step() (lr, betas, eps, weight_decay were {was[g]}, "
                f"now {now[g]}): tsd applied this step's update while backward ran, with the values at the step's "
                f"first gradient. Change hyperparameters before backward (LR schedulers do: call scheduler.step() "
                f"after optimizer.step()), or pass max_grad_norm to wrap() (updates then run at step())")

    def idle(self):
        """Waits until no delivery is in flight (between steps)."""
        if self.cuda:
            self.side_stream.synchronize()
        self.raise_async()
        if self.handle is not None:
            self.handle.wait_all()

    # ---- state
    def read_state(self):
        """{bucket: (master, exp_avg, exp_avg_sq, step)} from the daemon, as flat tensors."""
        self.idle()
        fd = _state.new_file()
        try:
            self.handle.save_state(fd)
            tensors, _ = _state.read(fd)
        finally:
            os.close(fd)
        return {b: (tensors[f"b{b}.master"], tensors[f"b{b}.exp_avg"], tensors[f"b{b}.exp_avg_sq"],
                    int(tensors[f"b{b}.step"][0])) for b in range(len(self.params))}

    def write_state(self, per_bucket, moment_dtype):
        """Loads {bucket: (master, exp_avg, exp_avg_sq, step)} into the daemon (every bucket)."""
        self.idle()
        mdt = torch.float32 if moment_dtype == "float32" else torch.bfloat16
        tensors = {}
        for b, (master, m, v, step) in sorted(per_bucket.items()):
            tensors[f"b{b}.master"] = master.reshape(-1).to(torch.float32)
            tensors[f"b{b}.exp_avg"] = m.reshape(-1).to(mdt)
            tensors[f"b{b}.exp_avg_sq"] = v.reshape(-1).to(mdt)
            tensors[f"b{b}.step"] = torch.tensor([int(step)], dtype=torch.int64)
        meta = {"format": _state.FORMAT, "buckets": str(len(per_bucket)),
                "moment_dtype": "F32" if moment_dtype == "float32" else "BF16", "committed": "0"}
        fd = _state.new_file()
        try:
            _state.write(fd, tensors, meta)
            self.handle.load_state(fd)
        finally:
            os.close(fd)
        for b in per_bucket:
            ps = self.params[b]
            ps.version = ps.param._version

    def release(self, keep_pager=False):
        """Removes the hooks and gives the job's memory back (when this session owns the client).
        `keep_pager`: activation paging stays on (the switch to stock AdamW: the VRAM it measured
        was with paging)."""
        for ps in self.params:
            if ps.hook is not None:
                ps.hook.remove()
                ps.hook = None
        if self.pager is not None and not keep_pager:
            self.pager.remove()
            self.pager = None
        self.offloading = False
        for ps in self.params:
            ps.master = ps.grad_slot = ps.param_slot = None
        self.handle = None
        if self.owns_client and self.client is not None:
            try:
                self.client.close()
            except TsdError:
                pass  # the daemon is gone; so is the job
        self.client = None


class TsdAdamW(torch.optim.Optimizer):
    """The optimizer `wrap()` returns: torch.optim.AdamW's interface, with the update done by tsd.

    `param_groups` is live (LR schedulers edit it); `state_dict()` reads the state from the daemon
    in torch.optim.AdamW's layout (plus each parameter's fp32 "master"); `load_state_dict()` writes
    it back. After `offload="auto"` switched to stock AdamW, every call goes to that optimizer."""

    def __init__(self, original, session, moment_dtype):
        self._session = session
        self._inner = None
        self.moment_dtype = moment_dtype
        super().__init__(original.param_groups, original.defaults)

    # The offloaded optimizer's own state lives in the daemon; torch's `state` stays empty.
    @property
    def offloading(self) -> bool:
        return self._inner is None

    def _check(self):
        s = self._session
        if s.closed:
            raise TsdError("this optimizer's model was unwrapped; wrap it again to train it")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check()
        s = self._session
        if self._inner is not None:
            if s.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], s.max_grad_norm)
            self._inner.step()
            s.steps += 1
            return loss
        t0 = time.perf_counter()
        try:
            s.finish_step(self)
        except TsdError:
            s.closed = True
            raise
        s.step_times.append(time.perf_counter() - t0)
        if s.offload == "auto" and s.steps == 2:
            _maybe_switch_to_stock(self)
        return loss

    def synchronize(self) -> None:
        """Waits until the daemon has applied every delivered update."""
        if self._inner is None:
            self._session.idle()

    # ---- state
    def _index(self):
        """Parameters in state_dict order (param_groups order), with their indices."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        if self._inner is not None:
            return self._inner.state_dict()
        self._check()
        sd = super().state_dict()
        s = self._session
        per_bucket = s.read_state()
        index = {id(p): i for i, p in enumerate(self._index())}
        state = {}
        for b, (master, m, v, step) in per_bucket.items():
            if step == 0:
                continue  # torch keeps no state for a parameter never stepped
            p = s.params[b].param
            state[index[id(p)]] = {"step": torch.tensor(float(step)), "exp_avg": m.view(p.shape),
                                   "exp_avg_sq": v.view(p.shape), "master": master.view(p.shape)}
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._inner is not None:
            return self._inner.load_state_dict(state_dict)
        self._check()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state_dict's param_groups do not match this optimizer's (number of groups or "
                             "parameters per group)")
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        s = self._session
        params = self._index()
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        per_bucket = {}
        for i, p in enumerate(params):
            ps = s.by_param.get(id(p))
            if ps is None:
                continue  # frozen: not in the daemon
            st = saved_state.get(i)
            flat = p.detach().reshape(-1).to("cpu", torch.float32)
            if st is None:
                zeros = torch.zeros(p.numel(), dtype=torch.float32)
                per_bucket[ps.bucket] = (flat, zeros, zeros, 0)
                continue
            master = st.get("master")
            # The model's parameter is the truth: the saved fp32 master is used only where it rounds
            # to the parameter (it adds precision below a bf16/fp16 parameter, never other values).
            if master is None or not torch.equal(master.reshape(-1).to(p.dtype).cpu(), p.detach().reshape(-1).cpu()):
                master = flat
            step = st["step"]
            step = int(step.item() if torch.is_tensor(step) else step)
            per_bucket[ps.bucket] = (master.reshape(-1).float().cpu(), st["exp_avg"].reshape(-1).cpu(),
                                     st["exp_avg_sq"].reshape(-1).cpu(), step)
        s.write_state(per_bucket, self.moment_dtype)

    def __repr__(self) -> str:
        mode = "offloaded to tsd" if self._inner is None else "switched to stock AdamW"
        return f"TsdAdamW({mode}, {len(self.param_groups)} groups, moments {self.moment_dtype})"


def _stock_fits(session, optimizer):
    """Whether stock AdamW on the device fits next to what the first steps used: the measured
    peak plus the gradients and moments stock AdamW keeps on the GPU, against the usable VRAM.
    Returns (fits, explanation). On a CPU device there is no VRAM to save: offloading stays."""
    if not session.cuda:
        return False, "device is cpu: offloading stays on"
    dev = session.device
    peak = torch.cuda.max_memory_allocated(dev)
    extra = 0
    for ps in session.params:
        n, now, own = ps.param.numel(), ps.param.element_size(), ps.orig_dtype.itemsize
        extra += n * (own - now) + 3 * n * own  # param_dtype= undone, then grads + exp_avg + exp_avg_sq
    total = torch.cuda.get_device_properties(dev).total_memory
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(dev)
    except (AttributeError, RuntimeError):
        fraction = 1.0
    budget = int(total * min(fraction, 1.0) * VRAM_HEADROOM)
    fits = peak + extra <= budget
    return fits, (f"peak {_fmt(peak)} + stock AdamW's gradients and moments {_fmt(extra)} "
                  f"{'<=' if fits else '>'} usable VRAM {_fmt(budget)}")


def _maybe_switch_to_stock(opt):
    s = opt._session
    fits, why = _stock_fits(s, opt)
    if not fits:
        s.events.append(f"offload=auto: keeps offloading ({why})")
        return
    per_bucket = s.read_state()
    s.restore_dtypes(per_bucket)  # stock AdamW steps the parameters in the model's own dtype
    inner_kw = {"fused": True, "foreach": False} if s.cuda else {"fused": False, "foreach": False}
    for g in opt.param_groups:
        g.update(inner_kw)
    s.release(keep_pager=True)  # the fit check measured the peak with the activations paged
    inner = torch.optim.AdamW(opt.param_groups, **inner_kw)
    for b, (master, m, v, step) in per_bucket.items():
        p = s.params[b].param
        if step == 0:
            continue
        step_t = torch.tensor(float(step), dtype=torch.float32, device=p.device if s.cuda else "cpu")
        inner.state[p] = {"step": step_t, "exp_avg": m.view(p.shape).to(p.device, p.dtype),
                          "exp_avg_sq": v.view(p.shape).to(p.device, p.dtype)}
    opt._inner = inner
    opt.state = inner.state
    s.events.append(f"offload=auto: switched to stock {'fused ' if s.cuda else ''}AdamW on {s.device} ({why}); "
                    f"the job's memory in tsd was released")


def _ranges(indices):
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, x in enumerate(indices):
        if start is None:
            start = x
        if i + 1 == len(indices) or indices[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)


def unwrap_session(model: torch.nn.Module) -> Optional[Session]:
    """The Session of a wrapped model (None when it is not wrapped)."""
    return getattr(model, "_trainstream_session", None)


def _check_options(options):
    known = {"offload": "auto", "moment_dtype": "auto", "max_grad_norm": None, "accumulation_steps": 1,
             "check_memory": True, "job": None, "quota": None, "socket": None, "seed": 0,
             "param_offload": False, "activation_offload": False, "quantize": None, "param_dtype": None}
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"wrap() got unknown options {sorted(unknown)}; it takes {sorted(known)}")
    out = dict(known, **options)
    if out["param_offload"] not in (False, None, "auto"):
        raise NotImplementedError(f"param_offload={out['param_offload']!r} is not implemented by tsd yet: the weights "
                                  f"stay on the GPU (param_dtype=torch.bfloat16 halves them; their fp32 masters live in "
                                  f"tsd); the optimizer and, with activation_offload, activations are offloaded")
    if out["quantize"] not in (None, "none"):
        raise NotImplementedError("quantize= is not implemented by tsd yet")
    if out["offload"] not in (True, "auto"):
        raise ValueError(f"offload must be True or 'auto', not {out['offload']!r} (without offloading, skip wrap())")
    pd = out["param_dtype"]
    if pd is not None:
        pd = _PARAM_DTYPES.get(pd)
        if pd is None:
            raise ValueError(f"param_dtype must be None, 'bfloat16', 'float16' or 'float32' (or the torch dtypes), not "
                             f"{out['param_dtype']!r}")
        out["param_dtype"] = pd
    if int(out["accumulation_steps"]) < 1:
        raise ValueError("accumulation_steps must be at least 1")
    if out["max_grad_norm"] is not None and not (float(out["max_grad_norm"]) >= 0 and math.isfinite(float(out["max_grad_norm"]))):
        raise ValueError("max_grad_norm must be a finite number >= 0")
    return out


def _collect(optimizer):
    """The trainable parameters by group, each unique tensor once (tied weights)."""
    seen = set()
    out = []
    index = 0
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in seen and p.requires_grad:
                if p.dtype not in _DTYPE_NAMES:
                    raise TypeError(f"parameter {index} is {p.dtype}; tsd updates float32, bfloat16 and float16 parameters")
                out.append((p, gi, index))
            seen.add(id(p))
            index += 1
    return out


def _hyper(g):
    b1, b2 = g["betas"]
    return {"lr": float(g["lr"]), "beta1": float(b1), "beta2": float(b2), "eps": float(g["eps"]),
            "weight_decay": float(g["weight_decay"])}


def _plan_memory(client, numels, dtypes, ngroups, moment_dtype, accumulate, check_memory, device, params, sizes):
    """Picks the moment dtype and refuses (check_memory) what cannot fit, with the numbers."""
    st = client.status()
    job = next((j for j in client.jobs() if j.name == client.job), None)
    job_used = job.used_bytes if job else 0
    avail = min(client.quota_bytes - job_used, st.free_bytes)
    need = {d: optimizer_bytes(numels, dtypes, ngroups, d, accumulate) for d in ("float32", "bfloat16")}
    if moment_dtype == "auto":
        moment_dtype = "float32" if need["float32"] <= avail else "bfloat16"
    if check_memory and need[moment_dtype] > avail:
        raise QuotaExceeded(
            f"tsd cannot hold this model's optimizer: it needs {_fmt(need[moment_dtype])} ({sum(numels):,} parameters: "
            f"fp32 master weights, {moment_dtype} moments, gradient and parameter slots"
            f"{', an fp32 accumulator' if accumulate else ''}); available: {_fmt(avail)} (the job's quota "
            f"{_fmt(client.quota_bytes)} with {_fmt(job_used)} used, the pool's free {_fmt(st.free_bytes)} of "
            f"{_fmt(st.pool_bytes)}). Start tsd with a larger --pool-size, free other jobs, or pass moment_dtype='bfloat16'"
            f" (needs {_fmt(need['bfloat16'])}); check_memory=False skips this check")
    if check_memory and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        on_dev = sum(p.numel() * size for p, size in zip(params, sizes) if p.device == device)
        off_dev = sum(p.numel() * size for p, size in zip(params, sizes) if p.device != device)
        largest_grad = max((p.numel() * size for p, size in zip(params, sizes)), default=0)
        if off_dev + largest_grad > free:
            raise QuotaExceeded(
                f"the model's weights do not fit on {device}: {_fmt(off_dev)} to move there plus {_fmt(largest_grad)} for "
                f"the largest gradient in flight, with {_fmt(free)} free ({_fmt(on_dev)} already there). tsd offloads the "
                f"optimizer, not the weights; check_memory=False skips this check")
    return moment_dtype, need[moment_dtype], avail


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Union[str, torch.device] = "cuda",
         client: Optional[Client] = None, **options: Any) -> tuple[torch.nn.Module, TsdAdamW]:
    """Moves `optimizer`'s work into tsd. Returns (model, optimizer), the optimizer a
    torch.optim.Optimizer whose step() waits for the daemon's updates and copies them back.

    Options (TrainStream's names): offload="auto" | True, moment_dtype="auto" | "float32" |
    "bfloat16", max_grad_norm=None, accumulation_steps=1, check_memory=True; and tsd's own:
    job= (default trainstream-<host>-<pid>-<n>), quota= (bytes or "8GiB"), socket=, seed=,
    param_dtype= (None, or torch.bfloat16 / torch.float16: the model's trainable parameters become
    working copies in that dtype on the device while tsd keeps their fp32 masters; unwrap() gives
    them back in their own dtype with the masters' values).
    See docs/python.md."""
    opts = _check_options(options)
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(f"tsd runs AdamW; wrap() takes torch.optim.AdamW (or Adam without weight decay), not "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, TsdAdamW):
        raise TypeError("this optimizer is already wrapped")
    if type(optimizer) is torch.optim.Adam and any(g["weight_decay"] for g in optimizer.param_groups):
        raise InvalidRequest("torch.optim.Adam's weight_decay is L2 regularisation, not AdamW's decoupled decay; "
                                "tsd runs AdamW: use torch.optim.AdamW")
    if unwrap_session(model) is not None:
        raise TypeError("this model is already wrapped; trainstream.unwrap(model) first")
    if opts["moment_dtype"] != "auto" and opts["moment_dtype"] not in _MOMENT_DTYPES:
        raise ValueError(f"moment_dtype must be 'auto', 'float32' or 'bfloat16', not {opts['moment_dtype']!r}")
    moment_dtype = opts["moment_dtype"] if opts["moment_dtype"] == "auto" else _MOMENT_DTYPES[opts["moment_dtype"]]
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device}")
    amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
    maximize = any(g.get("maximize", False) for g in optimizer.param_groups)

    act = opts["activation_offload"]
    paged_blocks = None
    if act not in (False, None, "auto"):
        blocks_name, block_list = find_blocks(model)
        if block_list is None:
            raise ValueError("activation_offload pages the activations of the model's repeated blocks, and this model "
                             "has no nn.ModuleList of blocks; pass activation_offload=False")
        paged_blocks = (blocks_name, block_list, choose_blocks(act, len(block_list)))

    trainable = _collect(optimizer)
    if not trainable:
        raise ValueError("the optimizer has no trainable parameters (every one has requires_grad=False)")
    buckets = list(reversed(trainable))  # last registered first: backward produces them first
    numels = [p.numel() for p, _, _ in buckets]
    # The dtype of each parameter's working copy in the model (and of its gradient and slots).
    work = opts["param_dtype"]
    dtypes = [_DTYPE_NAMES[work if work is not None else p.dtype] for p, _, _ in buckets]

    owns_client = client is None
    if client is None:
        job = opts["job"] or f"trainstream-{socket.gethostname()}-{os.getpid()}-{next(_jobs)}"
        client = Client(socket=opts["socket"], job=job, quota=opts["quota"])
    elif not client.attached:
        job = opts["job"] or f"trainstream-{socket.gethostname()}-{os.getpid()}-{next(_jobs)}"
        client.attach(job, opts["quota"])
    try:
        accumulate = int(opts["accumulation_steps"]) > 1
        moment_dtype, need, avail = _plan_memory(client, numels, dtypes, len(optimizer.param_groups), moment_dtype,
                                                 accumulate, opts["check_memory"], device, [b[0] for b in buckets],
                                                 [_DTYPE_BYTES[d] for d in dtypes])
        handle = client._register_optimizer(
            groups=[_hyper(g) for g in optimizer.param_groups],
            buckets=[(gi, n, d, d) for (_, gi, _), n, d in zip(buckets, numels, dtypes)],
            moment_dtype=moment_dtype, max_grad_norm=float(opts["max_grad_norm"] or 0.0), accumulate=accumulate,
            seed=int(opts["seed"]), amsgrad=amsgrad, maximize=maximize)
    except BaseException:
        if owns_client:
            client.close()
        raise

    session = Session(device, client, owns_client, opts)
    session.handle = handle
    session.moment_dtype = moment_dtype
    session.state_bytes = handle.state_bytes
    for b, (p, gi, index) in enumerate(buckets):
        ps = _Param(p, b, gi, index)
        ps.master, ps.grad_slot, ps.param_slot = handle.master(b), handle.grad(b), handle.param(b)
        session.sync_master(ps)  # from the parameter in its own dtype: param_dtype= casts after this
        if work is not None and p.dtype != work:
            p.data = p.data.to(device=device if device.type == "cuda" else p.device, dtype=work)
            ps.version = p._version
        session.params.append(ps)
        session.by_param[id(p)] = ps
    if device.type == "cuda":
        model.to(device)
    wrapped = TsdAdamW(optimizer, session, moment_dtype)
    if any(len(v) for v in optimizer.state.values()):
        wrapped.load_state_dict(optimizer.state_dict())  # an optimizer that already stepped keeps its state
    wrapped_ref = weakref.ref(wrapped)

    def hook(p):
        opt = wrapped_ref()
        if opt is not None:
            session.on_grad(opt, p)

    for ps in session.params:
        ps.hook = ps.param.register_post_accumulate_grad_hook(hook)
    if paged_blocks is not None:
        name, block_list, chosen = paged_blocks
        session.pager = ActivationPager(model, [block_list[i] for i in chosen], device)
        session.pager.install()
        session.events.append(f"activation_offload: the saved activations of blocks {_ranges(chosen)} of "
                              f"{name or 'the model'} ({len(chosen)} of {len(block_list)}) are paged to host memory")
    session.events.append(f"wrap: {len(buckets)} buckets, {sum(numels):,} parameters, {moment_dtype} moments, "
                          f"{'working copies in ' + _DTYPE_NAMES[work] + ' on ' + str(device) + ', ' if work else ''}"
                          f"{_fmt(handle.state_bytes)} in tsd (job {client.job!r}, {_fmt(avail)} was available), "
                          f"AdamW on {handle.threads} daemon threads ({handle.isa})")
    setattr(model, "_trainstream_session", session)
    return model, wrapped


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Gives the model back with its (updated) parameters on its device, removes the hooks and
    releases the job's memory in tsd. The wrapped optimizer cannot step afterwards."""
    session = unwrap_session(model)
    if session is None:
        raise ValueError("this model is not wrapped by trainstream")
    try:
        if session.offloading and session.handle is not None and not session.closed:
            try:
                if any(ps.param.dtype != ps.orig_dtype for ps in session.params):
                    session.restore_dtypes(session.read_state())  # idles first
                else:
                    session.idle()
            except TsdError as e:
                cast = "; parameters cast by param_dtype= keep that dtype" if session.param_dtype else ""
                warnings.warn(f"trainstream.unwrap: {e}{cast}")
    finally:
        session.release()
        session.closed = True
        del model._trainstream_session
    return model
