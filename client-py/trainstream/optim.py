"""`TsdAdamW`: the `torch.optim.Optimizer` that `wrap()` returns, a facade over the session's
daemon-side AdamW, and the switch of `offload="auto"` to stock AdamW when it fits."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from . import planner
from .engine import Session
from .errors import TsdError


class TsdAdamW(torch.optim.Optimizer):
    """The optimizer `wrap()` returns: torch.optim.AdamW's interface, with the update done by tsd.

    `param_groups` is live (LR schedulers edit it); `state_dict()` reads the state from the daemon
    in torch.optim.AdamW's layout (plus each parameter's fp32 "master"); `load_state_dict()` writes
    it back. After `offload="auto"` switched to stock AdamW, every call goes to that optimizer."""

    def __init__(self, original: torch.optim.Optimizer, session: Session, moment_dtype: str) -> None:
        self._session = session
        self._inner: Optional[torch.optim.AdamW] = None
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
            maybe_switch_to_stock(self)
        return loss

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global norm of the last step's gradients before clipping, as tsd computed it to clip
        them (what torch.nn.utils.clip_grad_norm_ returns). None without max_grad_norm (no norm is
        computed), before the first step, and after offload="auto" switched to stock AdamW."""
        s = self._session
        if self._inner is not None or s.max_grad_norm <= 0 or s.steps == 0 or s.handle is None:
            return None
        return float(s.handle.last_grad_norm)

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


def stock_adamw_fits(session: Session) -> tuple[bool, str]:
    """Whether stock AdamW on the device fits next to what the first steps used: the measured
    peak plus the gradients and moments stock AdamW keeps on the device, against the usable VRAM
    of the session's budget (measured now where wrap() was given none). On a CPU device there is
    no VRAM to save: offloading stays, unless a budget passed to wrap() gives one.
    Returns (fits, explanation)."""
    budget = session.budget.merged(planner.measure_device(session.device))
    peak = torch.cuda.max_memory_allocated(session.device) if session.cuda else 0
    extra = planner.stock_adamw_extra_bytes(
        (ps.param.numel(), ps.param.element_size(), ps.orig_dtype.itemsize) for ps in session.params)
    return planner.stock_adamw_fits(peak, extra, budget.vram_usable)


def maybe_switch_to_stock(opt: "TsdAdamW") -> None:
    """offload="auto", after the second step: moves the state out of tsd into
    torch.optim.AdamW and releases the job when stock AdamW fits (see stock_adamw_fits)."""
    s = opt._session
    fits, why = stock_adamw_fits(s)
    if not fits:
        s.events.append(f"offload=auto: keeps offloading ({why})")
        return
    per_bucket = s.read_state()
    s.restore_dtypes(per_bucket)  # stock AdamW steps the parameters in the model's own dtype
    fused = bool(s.cuda)
    for g in opt.param_groups:
        g.update(fused=fused, foreach=False)
    s.release(keep_pager=True)  # the fit check measured the peak with the activations paged
    inner = torch.optim.AdamW(opt.param_groups, fused=fused, foreach=False)
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
