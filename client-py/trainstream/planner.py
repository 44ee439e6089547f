"""The memory plan of a wrapped model: a budget in, a plan out.

`plan(budget, demand)` is pure: it talks to no daemon and changes nothing. It picks the moment
dtype and refuses (with `check_memory`) what cannot fit, naming each part and its size.
`wrap()` calls it before it allocates anything: it measures the `Budget` (the functions below,
and tsd's pool and the job's quota through `tsd_budget()`) unless one is passed in, asks the
daemon for the optimizer's layout (a dry run of the registration, `Client.plan_optimizer`), and
only then applies the plan. `trainstream.plan_wrap()` returns that plan without applying it.

A `Budget`'s fields are bytes; None means not measured (or not applicable: no VRAM on a CPU
device). `Budget.merged()` fills the fields one budget leaves None from another, so a caller can
fix a few fields (`wrap(..., budget=Budget(vram_usable=...))`) and have the rest measured.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from .client import Job, OptimizerLayout, Status
from .errors import QuotaExceeded
from .units import MOMENT_DTYPES, format_bytes

# How much of the GPU's memory a run may plan to use (the rest is the allocator's slack).
VRAM_HEADROOM = 0.9


def available_ram_bytes() -> int:
    """Host memory available to new allocations now: MemAvailable from /proc/meminfo, capped by
    the room left under this process's cgroup (v2) memory limit when it has one."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    if avail is None:
        raise OSError("/proc/meminfo has no MemAvailable line (Linux 3.14 or later is needed)")
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def _cgroup_room() -> Optional[int]:
    try:
        with open("/proc/self/cgroup") as f:
            path = next((ln.strip().split(":", 2)[2] for ln in f if ln.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError, IndexError):
        return None  # no cgroup v2 memory controller visible here: no limit beyond the machine's


def local_processes() -> int:
    """Training processes on this node that share its RAM: $LOCAL_WORLD_SIZE (as torchrun sets
    it), else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not a count of processes (an integer >= 1)")
    return n


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the machine and tsd offer one wrapped model, in bytes (None: not measured, or not
    applicable). `vram_usable` is the VRAM a run may plan to use: the device's memory, under any
    `torch.cuda.set_per_process_memory_fraction` cap, times VRAM_HEADROOM; `vram_free` is free
    now. `pool_total`/`pool_free` are tsd's pool; `quota`/`job_used` the job's; `ram_total`/
    `ram_available` the node's host memory; `processes` how many training processes share it."""

    vram_total: Optional[int] = None
    vram_usable: Optional[int] = None
    vram_free: Optional[int] = None
    ram_total: Optional[int] = None
    ram_available: Optional[int] = None
    processes: Optional[int] = None
    pool_total: Optional[int] = None
    pool_free: Optional[int] = None
    quota: Optional[int] = None
    job_used: Optional[int] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"Budget.{f.name} is bytes (an int >= 0) or None, not {v!r}")

    def merged(self, other: "Budget") -> "Budget":
        """This budget with its None fields taken from `other`."""
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is None})

    @property
    def tsd_available(self) -> Optional[int]:
        """What tsd can still lend the job: its quota's free part, at most the pool's free bytes."""
        if self.quota is None or self.pool_free is None:
            return None
        return max(0, min(self.quota - (self.job_used or 0), self.pool_free))


def measure_device(device: Union[str, torch.device]) -> Budget:
    """The VRAM fields of a budget for `device` (none on a CPU device)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return Budget()
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(dev)
    except (AttributeError, RuntimeError):
        fraction = 1.0
    free, _ = torch.cuda.mem_get_info(dev)
    return Budget(vram_total=total, vram_usable=int(total * min(fraction, 1.0) * VRAM_HEADROOM), vram_free=free)


def measure_host() -> Budget:
    """The host-memory fields of a budget: the node's RAM and the processes that share it."""
    ram_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Budget(ram_total=ram_total, ram_available=available_ram_bytes(), processes=local_processes())


def tsd_budget(status: Status, jobs: Sequence[Job], job: Optional[str], quota_request: int) -> Budget:
    """The tsd fields of a budget from the daemon's answers: the pool, and the quota the job has
    (when `job` exists) or would be granted on attach (`quota_request` bytes, 0 for the daemon's
    maximum, capped at the maximum, as tsd grants it)."""
    existing = next((j for j in jobs if j.name == job), None) if job is not None else None
    if existing is not None:
        quota, used = existing.quota_bytes, existing.used_bytes
    else:
        cap = status.max_job_quota_bytes
        quota, used = (min(quota_request, cap) if quota_request else cap), 0
    return Budget(pool_total=status.pool_bytes, pool_free=status.free_bytes, quota=quota, job_used=used)


@dataclasses.dataclass(frozen=True)
class Demand:
    """What a wrapped model needs. `optimizer`: the daemon's layout of its registration for each
    candidate moment dtype; `device`: the training device ("cuda:0", "cpu"); the weights' bytes still to move to the
    device and already there, and the largest gradient (in flight on the device at once)."""

    parameters: int
    optimizer: Mapping[str, OptimizerLayout]
    accumulate: bool = False
    device: str = "cpu"
    weights_to_move: int = 0
    weights_on_device: int = 0
    largest_grad: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decisions of `plan()`: the moment dtype and what tsd will hold (`state_bytes`, of the
    `available` bytes), with the budget and demand they came from."""

    moment_dtype: str
    state_bytes: int
    available: int
    budget: Budget
    demand: Demand

    def describe(self) -> str:
        layout = self.demand.optimizer[self.moment_dtype]
        parts = ", ".join(f"{what} {format_bytes(n)}" for what, n in layout.parts(self.moment_dtype))
        return (f"{self.demand.parameters:,} parameters, {self.moment_dtype} moments: {format_bytes(self.state_bytes)} "
                f"in tsd ({parts}) of {format_bytes(self.available)} available")


def plan(budget: Budget, demand: Demand, moment_dtype: str = "auto", check_memory: bool = True) -> Plan:
    """Picks the moment dtype ("auto": float32 when tsd can hold it, else bfloat16) and, with
    `check_memory`, raises QuotaExceeded for what cannot fit (tsd's share, then the weights in
    VRAM), naming each part, its size, and what would make it fit."""
    if moment_dtype != "auto" and moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"moment_dtype must be 'auto', 'float32' or 'bfloat16', not {moment_dtype!r}")
    missing = [d for d in MOMENT_DTYPES if d not in demand.optimizer]
    if missing:
        raise ValueError(f"the demand has no optimizer layout for {missing} moments")
    avail = budget.tsd_available
    if avail is None:
        raise ValueError("the budget has no quota or pool_free: measure tsd's side (tsd_budget) or pass them")
    need = {d: demand.optimizer[d].state_bytes for d in MOMENT_DTYPES}
    if moment_dtype == "auto":
        moment_dtype = "float32" if need["float32"] <= avail else "bfloat16"
    if check_memory and need[moment_dtype] > avail:
        layout = demand.optimizer[moment_dtype]
        parts = ", ".join(f"{what} {format_bytes(n)}" for what, n in layout.parts(moment_dtype))
        raise QuotaExceeded(
            f"tsd cannot hold this model's optimizer: it needs {format_bytes(need[moment_dtype])} "
            f"({demand.parameters:,} parameters: {parts}); available: {format_bytes(avail)} (the job's quota "
            f"{format_bytes(budget.quota or 0)} with {format_bytes(budget.job_used or 0)} used, the pool's free "
            f"{format_bytes(budget.pool_free or 0)} of {format_bytes(budget.pool_total or 0)}). Start tsd with a larger "
            f"--pool-size, free other jobs, pass a larger quota=, or pass moment_dtype='bfloat16' (needs "
            f"{format_bytes(need['bfloat16'])}); check_memory=False skips this check")
    if check_memory and demand.device.startswith("cuda") and budget.vram_free is not None:
        if demand.weights_to_move + demand.largest_grad > budget.vram_free:
            raise QuotaExceeded(
                f"the model's weights do not fit on {demand.device}: {format_bytes(demand.weights_to_move)} to move there plus "
                f"{format_bytes(demand.largest_grad)} for the largest gradient in flight, with "
                f"{format_bytes(budget.vram_free)} free ({format_bytes(demand.weights_on_device)} already there). tsd "
                f"offloads the optimizer, not the weights; check_memory=False skips this check")
    return Plan(moment_dtype=moment_dtype, state_bytes=need[moment_dtype], available=avail, budget=budget,
                demand=demand)


def stock_adamw_extra_bytes(params: Iterable[tuple[int, int, int]]) -> int:
    """The VRAM stock AdamW needs beyond what the offloaded run uses, for parameters given as
    (numel, bytes per element now, bytes per element in the model's own dtype): a param_dtype=
    cast undone, then gradients, exp_avg and exp_avg_sq in the model's dtype."""
    return sum(n * (own - now) + 3 * n * own for n, now, own in params)


def stock_adamw_fits(peak: int, extra: int, usable: Optional[int]) -> tuple[bool, str]:
    """Whether stock AdamW fits next to what the first steps used (the measured `peak` plus
    `extra`) in `usable` bytes of device memory; None (a CPU device) keeps offloading.
    Returns (fits, explanation)."""
    if usable is None:
        return False, "device is cpu: offloading stays on"
    fits = peak + extra <= usable
    return fits, (f"peak {format_bytes(peak)} + stock AdamW's gradients and moments {format_bytes(extra)} "
                  f"{'<=' if fits else '>'} usable VRAM {format_bytes(usable)}")

# The block planner of weight paging (param_offload="auto"), under the names TrainStream gives it here.
from .blockplan import MemoryPlanner, spread  # noqa: E402,F401
