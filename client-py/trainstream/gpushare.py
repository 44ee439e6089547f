"""The GPU-resident share of the optimizer (`wrap(optimizer_gpu_fraction=...)`).

tsd's CPU AdamW is bound by the host's memory bandwidth (about 28 bytes per parameter with fp32
moments, plus 4 over PCIe), while the GPU sits idle during it. The share moves the optimizer of
part of the parameters back onto the model's device: their fp32 masters and moments live in VRAM
and torch's AdamW updates them at `step()` (fused on CUDA; the plain loop on the CPU, so the path
runs in CI); the rest stays in tsd as before. Results equal an all-tsd run within 1e-6 (fp32), not
bit for bit: two AdamW implementations.

Which parameters: the ones whose gradients finish last in backward (the embedding and the first
blocks), since a tsd update cannot start before its gradient arrives and those would otherwise
be the tail of the step. wrap() registers parameters last layer first (backward order), so the
share is taken from the end of that order. Parameters of blocks that weight paging may page
(`param_offload=`) stay in tsd: their only copy is their tsd slot.

How much (`choose()`): a float is a share of the trainable elements (whole tensors, each taken
while at least half of it fits the share); `0` is tsd alone, `1` everything on the device, with no
optimizer registered in tsd at all. `"auto"` is chosen after a measured step (share_auto.py, which
calls choose() with the room that step left); only under data parallel, whose ranks must agree
before the share exists, is it fixed at wrap() from `vram_room()`: the usable VRAM less the
resident weights, the gradients in flight and the activation reserve the weight-paging planner
keeps for unmeasured activations (`blockplan.ACTIVATION_RESERVE`). Either way the share gets as
many of the last-finishing parameters as fit in the room (each costs its fp32 moments, its fp32
gradient and, where the working copy is not fp32, an fp32 master). A GPU update costs about 1/25
of a host update per parameter (123 against 4.75 Gparam/s on the H200 host), so within that room a
larger share never lengthens a step: it shortens the host's part, which the event line reports
(bytes per parameter over the host bandwidth, measured once here) for comparison with the
forward and backward. On a CPU device without a `budget=` giving VRAM, "auto" is 0.

`1` is also where `offload="auto"` goes when stock AdamW fits after two steps
(`optim.maybe_switch_to_stock`): the tsd buckets' state moves into this share and the job's
optimizer memory is released. One mechanism, one decision.

Clipping (`max_grad_norm`) uses the global norm over both shares. tsd computes the norm over its
held buckets at the commit; the share's part joins it through one extra one-element bucket (the
"norm bucket", in a group of its own with lr=0, so its own update changes nothing anyone reads):
at `step()` the share delivers its gradients' norm there, so tsd's sum of squares is the global
one. The share then clips with the coefficient tsd used (read from the control page once the
norm bucket, first in tsd's order, is done), as torch.nn.utils.clip_grad_norm_ computes it.

The share's state is torch's (`state_dict()` gives it in torch.optim.AdamW's layout, the tensors
torch's own, which later steps change); it lives in this process, so `resume=` and `keep_for=`
(tsd keeps the state of a dead trainer) take only a share of 0.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from .blockplan import ACTIVATION_RESERVE
from .client import OptimizerLayout
from .units import format_bytes

if TYPE_CHECKING:
    from .engine import Session
    from .planner import Budget, Demand

__all__ = ["GpuShare", "ShareChoice", "check_fraction", "choose", "install", "vram_room", "vram_cost",
           "EMPTY_LAYOUT", "NORM_GROUP", "host_bytes_per_param"]

Fraction = Union[str, float]

# The layout of "no optimizer in tsd" (everything in the share): nothing registered, nothing lent.
EMPTY_LAYOUT = OptimizerLayout(state_bytes=0, control_bytes=0, master_bytes=0, moment_bytes=0, grad_bytes=0,
                               param_bytes=0, accum_bytes=0, buckets=())
# The norm bucket's group: lr=0 and no decay, so its update leaves its master at 0.
NORM_GROUP = {"lr": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def check_fraction(value: Any) -> Fraction:
    """wrap()'s `optimizer_gpu_fraction`: "auto", or a real number in [0, 1] (returned as a float)."""
    if isinstance(value, str):
        if value == "auto":
            return value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        f = float(value)
        if math.isfinite(f) and 0.0 <= f <= 1.0:
            return f
    raise ValueError(f"optimizer_gpu_fraction must be 'auto' or a number in [0, 1] (the share of the trainable "
                     f"parameters whose optimizer stays on the GPU: 0 keeps all of it in tsd, 1 none of it), "
                     f"not {value!r}")


def vram_cost(numel: int, work_bytes: int) -> int:
    """The VRAM the share needs for a parameter of `numel` elements whose working copy has
    `work_bytes` bytes per element: fp32 exp_avg and exp_avg_sq, an fp32 gradient, and an fp32
    master unless the working copy is fp32 itself (then it is its own master)."""
    return numel * (12 + (0 if work_bytes == 4 else 4))


def host_bytes_per_param(moment_dtype: str) -> int:
    """Host memory traffic of one tsd update per parameter: master read and written (8), both
    moments read and written (16 fp32, 8 bf16), the gradient read (4) and the parameter written
    (4 at most), as issue 14 counts them (28 with fp32 moments, 20 with bf16), plus the 4 bytes of
    its PCIe copies."""
    return (28 if moment_dtype == "float32" else 20) + 4


_bandwidth: Optional[float] = None


def host_bandwidth() -> float:
    """The host's memory bandwidth in bytes/s, measured once per process: the best of three
    copies of 64 MiB with torch (read and write counted), about 10 ms."""
    global _bandwidth
    if _bandwidth is None:
        a = torch.empty(16 << 20, dtype=torch.float32)
        b = torch.empty_like(a)
        a.fill_(1.0)
        b.copy_(a)  # first touch
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
        _bandwidth = 2 * a.numel() * a.element_size() / max(best, 1e-9)
    return _bandwidth


@dataclasses.dataclass(frozen=True)
class ShareChoice:
    """Which parameters the GPU share holds (`ids`: their `id()`), how many elements (`numel`, of
    `total`), their VRAM (`vram_bytes`), the option it came from, why (a sentence) and how many
    candidates "auto" passed over as too large for the room (`passed`, only without `prefix`)."""

    ids: frozenset[int]
    numel: int
    total: int
    vram_bytes: int
    option: Fraction
    why: str
    passed: int = 0

    @property
    def fraction(self) -> float:
        return self.numel / self.total if self.total else 0.0


def vram_room(budget: "Budget", demand: "Demand") -> Optional[int]:
    """The VRAM "auto" may give the share: the usable VRAM less what the run keeps resident before
    its activations (`Demand.vram_resident`) less the activation reserve; None without a VRAM
    budget (a CPU device not given one)."""
    usable = budget.vram_usable
    if usable is None:
        return None
    return max(0, usable - demand.vram_resident - int(usable * ACTIVATION_RESERVE))


def choose(option: Fraction, trainable: Sequence[tuple[torch.Tensor, int]], room: Optional[int],
           excluded: Iterable[int] = (), moment_dtype: str = "float32", limit: Optional[int] = None,
           prefix: bool = True) -> ShareChoice:
    """The share for `option` (checked by check_fraction). `trainable`: each trainable parameter
    with its working copy's bytes per element, in wrap()'s bucket order (backward order: the last
    finish last); `room`: `vram_room()` (for "auto"); `excluded`: ids that must stay in tsd (paged
    blocks). With `prefix` the share is the first tensors of the candidates (the last to finish)
    and "auto" stops at the first that does not fit, so `limit` (at most that many tensors: data
    parallel's ranks agreeing on the smallest "auto" share) keeps a prefix of what it would have
    been. Without it (one rank deciding alone, share_auto) "auto" passes over a tensor that does
    not fit (a large tied embedding, first in line) and goes on with the next ones."""
    skip = set(excluded)
    total = sum(p.numel() for p, _ in trainable)
    candidates = [(p, w) for p, w in reversed(trainable) if id(p) not in skip]
    if limit is not None:
        candidates = candidates[:limit]
    ids: list[int] = []
    numel = vram = 0
    if option == "auto":
        if room is None:
            return ShareChoice(frozenset(), 0, total, 0, option, "optimizer_gpu_fraction=auto: no VRAM budget (the "
                               "device is the CPU): everything stays in tsd")
        misfits = passed = 0  # passed: the misfits before a tensor taken after them (prefix=False)
        for p, w in candidates:
            cost = vram_cost(p.numel(), w)
            if vram + cost > room:
                if prefix:
                    break
                misfits += 1
                continue
            passed = misfits
            ids.append(id(p))
            numel += p.numel()
            vram += cost
        left = total - numel
        host_s = left * host_bytes_per_param(moment_dtype) / host_bandwidth()
        why = (f"optimizer_gpu_fraction=auto: {numel:,} of {total:,} parameters ({numel / max(1, total):.0%}) on the device, "
               f"{format_bytes(vram)} of the {format_bytes(room)} of VRAM left after the weights, gradients in flight "
               f"and the activation reserve; tsd's share takes about {host_s * 1e3:.1f} ms of host time per step "
               f"({host_bytes_per_param(moment_dtype)} B/parameter at {host_bandwidth() / 1e9:.1f} GB/s measured)"
               + (f"; passed over {passed} tensors too large for the room left" if passed else ""))
        return ShareChoice(frozenset(ids), numel, total, vram, option, why, passed)
    target = float(option) * total
    for p, w in candidates:
        n = p.numel()
        if option != 1.0 and numel + n / 2 > target:
            break
        ids.append(id(p))
        numel += n
        vram += vram_cost(n, w)
    kept = f" ({len(skip)} parameters of pageable blocks stay in tsd)" if skip and option != 0.0 else ""
    why = (f"optimizer_gpu_fraction={option}: {numel:,} of {total:,} parameters ({numel / max(1, total):.0%}) "
           f"on the device, {format_bytes(vram)} of VRAM{kept}")
    return ShareChoice(frozenset(ids), numel, total, vram, option, why)


def install(session: "Session", gpu: Sequence[tuple[torch.nn.Parameter, int, int]], num_groups: int,
            work: Optional[torch.dtype], norm_bucket: Optional[int]) -> Optional["GpuShare"]:
    """wrap(): the share of `gpu` ((parameter, group, index), before param_dtype= casts anything)
    on `session`, and tsd's norm bucket (`norm_bucket`: its index, last) with its group (lr=0).
    `session.offloading` says whether tsd holds any of the optimizer."""
    session.offloading = session.handle is not None
    if norm_bucket is not None:
        session.norm_bucket = norm_bucket
        session.norm_slot = session.handle.grad(norm_bucket)
        session.handle.set_group(num_groups, **NORM_GROUP)
    share = GpuShare(session.device, num_groups) if gpu else None
    for p, gi, index in gpu:
        share.add(p, gi, index, work)  # type: ignore[union-attr]
    session.share = share
    return share


class _Entry:
    __slots__ = ("param", "group", "index", "master", "orig_dtype", "version", "hook")

    def __init__(self, param: torch.nn.Parameter, group: int, index: int, master: torch.Tensor,
                 orig_dtype: torch.dtype) -> None:
        self.param, self.group, self.index, self.master, self.orig_dtype = param, group, index, master, orig_dtype
        self.version = param._version
        self.hook: Optional[torch.utils.hooks.RemovableHandle] = None

    @property
    def own(self) -> bool:
        """The parameter is its own master (an fp32 working copy)."""
        return self.master is self.param


class GpuShare:
    """The parameters whose AdamW runs on the model's device, with their fp32 masters and
    torch.optim.AdamW (fused on CUDA) over them. Gradients of parameters with a separate master
    are accumulated into the master's fp32 `.grad` by a post-accumulate-grad hook (as tsd sums
    micro-batches in fp32) and freed from the parameter; an fp32 parameter is its own master and
    keeps its `.grad`. `step()` copies updated masters into their working copies."""

    def __init__(self, device: torch.device, num_groups: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.num_groups = num_groups
        self.entries: list[_Entry] = []
        self.by_param: dict[int, _Entry] = {}
        self.inner: Optional[torch.optim.AdamW] = None
        self._groups: list[int] = []  # inner group -> the wrapped optimizer's group
        self.last_norm: Optional[float] = None
        self._placed = True  # every state tensor is on its master's device

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def numel(self) -> int:
        return sum(e.param.numel() for e in self.entries)

    def add(self, p: torch.nn.Parameter, group: int, index: int, work: Optional[torch.dtype],
            master: Optional[torch.Tensor] = None) -> None:
        """Takes `p` into the share. `work`: param_dtype= (p becomes a working copy in it on the
        device); `master`: fp32 values for its master (default: p's own). Call before build()."""
        orig = p.dtype
        dest = self.device if self.cuda else p.device
        working = work if work is not None else p.dtype
        if working == torch.float32:
            if p.dtype != torch.float32:
                p.data = p.data.to(device=dest, dtype=torch.float32)
            if master is not None:
                with torch.no_grad():
                    p.copy_(master.view(p.shape))
            m: torch.Tensor = p
        else:
            src = master.view(p.shape) if master is not None else p.detach()
            m = src.to(device=self.device, dtype=torch.float32, copy=True)
            if p.dtype != working:
                p.data = p.data.to(device=dest, dtype=working)
            if master is not None:
                with torch.no_grad():
                    p.copy_(m)
        e = _Entry(p, group, index, m, orig)
        self.entries.append(e)
        self.by_param[id(p)] = e

    def build(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Creates torch's AdamW over the masters, one group per wrapped group that has any (fused
        AdamW checks its tensors' device at its first step, by when wrap() moved the model), and
        keeps the state it had."""
        groups = []
        self._groups = []
        for gi in range(self.num_groups):
            masters = [e.master for e in self.entries if e.group == gi]
            if masters:
                groups.append(_inner_group(param_groups[gi], masters))
                self._groups.append(gi)
        old = self.inner.state if self.inner is not None else {}
        if not groups:
            self.inner = None
            return
        self.inner = (torch.optim.AdamW(groups, fused=True) if self.cuda
                      else torch.optim.AdamW(groups, foreach=False))
        for k, v in old.items():
            self.inner.state[k] = v

    def hook_gradients(self) -> None:
        """Post-accumulate-grad hooks for the parameters with a separate master."""
        for e in self.entries:
            if not e.own and e.hook is None:
                e.hook = e.param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        e = self.by_param.get(id(p))
        g = p.grad
        if e is None or g is None:
            return
        if p._version != e.version:
            self._sync_master(e)  # changed outside the optimizer: the master follows
        if e.master.grad is None:
            e.master.grad = g.detach().to(dtype=torch.float32, copy=True)
        else:
            e.master.grad.add_(g.detach())
        p.grad = None

    @staticmethod
    def _sync_master(e: _Entry) -> None:
        with torch.no_grad():
            e.master.copy_(e.param.detach())
        e.version = e.param._version

    def grads(self) -> list[torch.Tensor]:
        return [e.master.grad for e in self.entries if e.master.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The fp32 norm of the share's gradients (0 without any), on the device."""
        gs = self.grads()
        if not gs:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in gs]
        return torch.linalg.vector_norm(torch.stack(norms))

    # ---- the step
    def deliver_norm(self, session: "Session") -> bool:
        """With clipping and a tsd share: writes this share's gradient norm into tsd's norm
        bucket and rings it, so that the commit's norm is the global one. False without a norm
        bucket."""
        nb = getattr(session, "norm_bucket", None)
        if nb is None or session.handle is None:
            return False
        h = session.handle
        h.wait(nb)  # the last step's delivery was taken (its slot is free)
        session.norm_slot.copy_(self.grad_norm().reshape(1).to("cpu"))
        h.ready(nb, True, True)
        return True

    def step(self, optimizer: torch.optim.Optimizer, session: "Session") -> None:
        """The share's update at step(), after tsd's commit: clipped by the global norm tsd
        computed (with `max_grad_norm` and a tsd share), or by its own (everything here)."""
        session.check_hyper(session.group_hyper(optimizer))  # as tsd's share is checked: a clear error
        max_norm = session.max_grad_norm
        if max_norm > 0:
            nb = getattr(session, "norm_bucket", None)
            if session.offloading and nb is not None:
                session.wait_bucket(nb)  # the commit's norm is on the page
                norm = float(session.handle.last_grad_norm)
                coef = torch.clamp(torch.tensor(max_norm, dtype=torch.float32) /
                                   (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
                gs = self.grads()
                if gs:
                    torch._foreach_mul_(gs, coef.to(gs[0].device))
                self.last_norm = norm
            else:
                params = [e.master for e in self.entries if e.master.grad is not None]
                self.last_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self._update(optimizer)

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        if self.inner is None:
            return
        for inner_g, gi in zip(self.inner.param_groups, self._groups):
            g = optimizer.param_groups[gi]
            inner_g.update(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
        for e in self.entries:
            if not e.own and e.param._version != e.version and e.master.grad is None:
                self._sync_master(e)  # changed outside the optimizer, no gradient this step
        if not self._placed:
            self._place()
        self.inner.step()
        with torch.no_grad():
            for e in self.entries:
                if e.own:
                    continue
                if e.master.grad is not None:
                    e.param.copy_(e.master)
                    e.master.grad = None
                e.version = e.param._version

    # ---- state
    def state_of(self, p: torch.Tensor) -> Optional[dict[str, Any]]:
        """p's state in torch.optim.AdamW's layout plus its fp32 "master" (None: never stepped)."""
        e = self.by_param[id(p)]
        st = self.inner.state.get(e.master) if self.inner is not None else None
        if not st or "exp_avg" not in st:
            return None
        return {"step": torch.tensor(float(st["step"])), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                "master": e.master.detach()}

    def load(self, p: torch.Tensor, master: torch.Tensor, st: Optional[Mapping[str, Any]]) -> None:
        """Sets p's master (fp32 values) and moments (`st`: torch's layout, None: never stepped)."""
        e = self.by_param[id(p)]
        with torch.no_grad():
            e.master.copy_(master.view(e.master.shape))
            if not e.own:
                e.param.copy_(e.master)
        e.version = e.param._version
        assert self.inner is not None
        self.inner.state.pop(e.master, None)
        if st is None:
            return
        step = st["step"]
        self.set_state(e, float(step.item() if torch.is_tensor(step) else step), st["exp_avg"], st["exp_avg_sq"])

    def set_state(self, e: _Entry, step: float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        assert self.inner is not None
        dev = e.master.device
        self.inner.state[e.master] = {
            "step": torch.tensor(step, dtype=torch.float32, device=dev if self.cuda else "cpu"),
            "exp_avg": exp_avg.detach().reshape(e.master.shape).to(dev, torch.float32, copy=True),
            "exp_avg_sq": exp_avg_sq.detach().reshape(e.master.shape).to(dev, torch.float32, copy=True)}
        self._placed = False  # wrap() may load state before the model moves to its device

    def _place(self) -> None:
        assert self.inner is not None
        for e in self.entries:
            st = self.inner.state.get(e.master)
            if not st:
                continue
            dev = e.master.device
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].to(dev)
            if self.cuda:
                st["step"] = st["step"].to(dev)
        self._placed = True

    def adopt(self, items: Iterable[tuple[torch.nn.Parameter, int, int, torch.Tensor, torch.Tensor, torch.Tensor, int]],
              param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Takes over parameters tsd held, with their state (offload="auto"'s switch): each item
        is (parameter, group, index, fp32 master, exp_avg, exp_avg_sq, step)."""
        states = []
        for p, group, index, master, exp_avg, exp_avg_sq, step in items:
            self.add(p, group, index, None, master=master)
            states.append((self.by_param[id(p)], step, exp_avg, exp_avg_sq))
        self.build(param_groups)
        for e, step, exp_avg, exp_avg_sq in states:
            if step > 0:
                self.set_state(e, float(step), exp_avg, exp_avg_sq)

    def give_back(self) -> None:
        """unwrap(): removes the hooks; a parameter cast by param_dtype= gets its own dtype back
        with its master's values."""
        for e in self.entries:
            if e.hook is not None:
                e.hook.remove()
                e.hook = None
            if not e.own and e.param.dtype != e.orig_dtype:
                e.param.data = e.master.detach().to(e.param.device, e.orig_dtype)
        self.inner = None


def _inner_group(g: Mapping[str, Any], masters: list[torch.Tensor]) -> dict[str, Any]:
    return {"params": masters, "lr": g["lr"], "betas": g["betas"], "eps": g["eps"],
            "weight_decay": g["weight_decay"]}
