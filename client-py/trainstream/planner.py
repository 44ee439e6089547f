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
import itertools
import os
from typing import Any, Collection, Iterable, Mapping, Optional, Sequence, Union

import torch

from .client import Job, OptimizerLayout, Status
from .errors import MemoryCheckFailed, Refusal
from .gpushare import vram_cost
from .units import MOMENT_DTYPES, block_ranges, format_bytes

# How much of the GPU's memory a run may plan to use (the rest is the allocator's slack).
VRAM_HEADROOM = 0.9
# How much of the node's available RAM a run may plan to take (the rest is the kernel's and other
# processes' slack).
RAM_HEADROOM = 0.9
# The most host memory the client holds at once when it streams state (unwrap(), the optimizer's
# save and restore): one parameter's chunk at a time.
STREAM_BUFFER = 64 << 20


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


# cuBLAS workspaces a training step makes: torch gives each (cuBLAS handle, stream) pair its own,
# from the caching allocator, and handles are per thread, so the caller's forward and autograd's
# device thread (backward) hold one each once they have run a matmul.
BLAS_WORKSPACES_PER_STEP = 2


def blas_workspace_bytes(major: int, config: Optional[str] = None) -> int:
    """The bytes of one cuBLAS workspace torch allocates on a device of compute capability
    `major`: `config` is CUBLAS_WORKSPACE_CONFIG (":KIB:COUNT" pairs, e.g. ":4096:8"), else torch's
    default: 32 MiB from Hopper (9.x) on, as NVIDIA recommends there, and 4096 KiB x 2 + 16 KiB x 8
    before it. A config that does not parse counts as the default (torch warns about it itself)."""
    if config:
        parts = config.split(":")
        if parts[0] == "" and len(parts) >= 3 and len(parts) % 2 == 1:
            try:
                sizes = [int(x) for x in parts[1:]]
            except ValueError:
                sizes = []
            if sizes and all(x >= 0 for x in sizes):
                return sum(sizes[i] * sizes[i + 1] for i in range(0, len(sizes), 2)) * 1024
    return 32 * 1024 * 1024 if major >= 9 else (4096 * 2 + 16 * 8) * 1024


def blas_workspaces(device: Union[str, torch.device]) -> int:
    """The VRAM of the cuBLAS workspaces a training step on `device` makes (0 on a CPU device):
    BLAS_WORKSPACES_PER_STEP of `blas_workspace_bytes` (64 MiB on Hopper, a large share of a small
    cap). They are allocated through torch's caching allocator at the first matmul of each thread,
    so a measured peak holds them; a plan made before any step must count them itself."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    if torch.cuda.is_available():
        major = torch.cuda.get_device_properties(dev if dev.index is not None else torch.cuda.current_device()).major
    else:
        major = 9  # planning for a device this process cannot see: the larger, Hopper-on size
    return BLAS_WORKSPACES_PER_STEP * blas_workspace_bytes(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def measure_device(device: Union[str, torch.device]) -> Budget:
    """The VRAM fields of a budget for `device` (none on a CPU device): `vram_usable` from the
    device's memory and any `torch.cuda.set_per_process_memory_fraction` cap, times VRAM_HEADROOM;
    `vram_free` from `torch.cuda.mem_get_info`, at most what the cap leaves beside torch's reserved
    memory."""
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
    if fraction < 1.0:
        # Under a per-process cap, this process can take at most the cap less what its allocator holds.
        free = min(free, max(0, int(total * fraction) - torch.cuda.memory_reserved(dev)))
    return Budget(vram_total=total, vram_usable=int(total * min(fraction, 1.0) * VRAM_HEADROOM), vram_free=free)


# unwrap() gives weights back to the device only when they take at most this share of its room.
GIVE_BACK_SHARE = 0.9


def device_room(device: Union[str, torch.device]) -> int:
    """What this process may still allocate on CUDA `device`: its free memory under any per-process
    cap (`measure_device`: `set_per_process_memory_fraction` is not in `mem_get_info`), plus what
    torch's allocator holds unused."""
    dev = torch.device(device)
    free = int(measure_device(dev).vram_free or 0)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


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
    candidate moment dtype; `device`: the training device ("cuda:0", "cpu").

    VRAM: `weights_to_move` and `weights_on_device` are the bytes of the weights that will be
    resident on the device (trainable ones in their working dtype, frozen ones in their dtype or
    quantized size), still to move there and already there; `largest_grad` the largest gradient (in
    flight on the device at once). With weight paging, the paged blocks' weights are not resident:
    `weights_paged` counts them, `paged_region_bytes` the tsd memory they take beyond the
    optimizer's parameter slots (frozen weights paged from a region of their own; trained ones are
    paged from their slot), and `paged_inflight` the VRAM the paged blocks in flight need
    (prefetch). `frozen_weights` is the bytes of the resident frozen block weights that quantize=
    could shrink (unquantized) and `quantized` the format wrap() will quantize them to (None:
    none), for the refusal's advice. Buffers count as resident weights; already quantized
    weights at their quantized size.

    Host: `host_parts` is what the client process itself allocates in host memory beyond tsd's
    regions, as (what, bytes)."""

    parameters: int
    optimizer: Mapping[str, OptimizerLayout]
    accumulate: bool = False
    device: str = "cpu"
    weights_to_move: int = 0
    weights_on_device: int = 0
    largest_grad: int = 0
    weights_paged: int = 0
    paged_region_bytes: int = 0
    paged_inflight: int = 0
    frozen_weights: int = 0
    quantized: Optional[str] = None
    host_parts: tuple[tuple[str, int], ...] = ()
    gpu_optimizer: int = 0  # the GPU share's masters, moments and gradients (optimizer_gpu_fraction, gpushare.py)
    blas_workspaces: int = 0  # cuBLAS's workspaces the first step makes (blas_workspaces())

    def __post_init__(self) -> None:
        for name in ("parameters", "weights_to_move", "weights_on_device", "largest_grad", "weights_paged",
                     "paged_region_bytes", "paged_inflight", "frozen_weights", "gpu_optimizer", "blas_workspaces"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Demand.{name} is a count (an int >= 0), not {v!r}")
        for what, n in self.host_parts:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"Demand.host_parts: {what!r} needs bytes (an int >= 0), not {n!r}")

    @property
    def vram_resident(self) -> int:
        """The VRAM the run needs before its activations: resident weights, the largest gradient
        in flight, the paged blocks in flight, the GPU share of the optimizer and cuBLAS's
        workspaces."""
        return (self.weights_to_move + self.weights_on_device + self.largest_grad + self.paged_inflight
                + self.gpu_optimizer + self.blas_workspaces)

    def tsd_bytes(self, moment_dtype: str) -> int:
        """What tsd will lend the job at wrap(): the optimizer's state and the paged weights'
        region."""
        return self.optimizer[moment_dtype].state_bytes + self.paged_region_bytes

    def host_bytes(self, moment_dtype: str) -> int:
        """The new host memory the run needs: tsd's regions (allocated, populated and locked when
        the job takes them) and the client's own host needs."""
        return self.tsd_bytes(moment_dtype) + sum(n for _, n in self.host_parts)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decisions of `plan()`: the moment dtype and what tsd will hold (`state_bytes`, of the
    `available` bytes), the host memory the run takes (`host_bytes`, of `host_room`: None when
    the node's RAM was not measured), with the budget and demand they came from."""

    moment_dtype: str
    state_bytes: int
    available: int
    budget: Budget
    demand: Demand
    host_bytes: int = 0
    host_room: Optional[int] = None
    gpu_share: Any = None  # gpushare.ShareChoice: the parameters whose optimizer stays on the device

    def describe(self) -> str:
        layout = self.demand.optimizer[self.moment_dtype]
        parts = ", ".join(f"{what} {format_bytes(n)}" for what, n in layout.parts(self.moment_dtype))
        host = (f"; host RAM {format_bytes(self.host_bytes)} of {format_bytes(self.host_room)} this process may take"
                if self.host_room is not None else "")
        return (f"{self.demand.parameters:,} parameters, {self.moment_dtype} moments: {format_bytes(self.state_bytes)} "
                f"in tsd ({parts}) of {format_bytes(self.available)} available{host}")


def model_demand(model: torch.nn.Module, trainable: Sequence[tuple[torch.Tensor, int]], device: torch.device,
                 optimizer: Mapping[str, OptimizerLayout], *, accumulate: bool = False, quantize: Optional[str] = None,
                 quant_block_size: int = 64, prefer: str = "exact", budget: Optional[Budget] = None,
                 paged: Collection[int] = frozenset(), paged_inflight: int = 0,
                 paged_blocks: Sequence[Collection[int]] = (), may_page: bool = False) -> Demand:
    """The `Demand` of wrapping `model` for `device`. `trainable`: each trained parameter with the
    bytes per element of its working copy (param_dtype=); every other parameter (and buffer) of
    the model is frozen and counted in its dtype, or at its quantized size when it is quantized
    already or `quantize` ("int8", "nf4", or "auto", decided as wrap() decides it from
    `budget.vram_usable`) will quantize it. `paged`: the
    ids (`id(p)`) of the parameters of paged blocks, which stay in tsd memory instead of VRAM (the
    weight pager's plan); `paged_inflight`: the VRAM its blocks in flight take. `paged_blocks`:
    the same ids block by block; the two largest blocks, counted as above (working dtype,
    quantized size), are added to `paged_inflight` (two blocks on the device at once at the least).
    `may_page` (param_offload="auto"): `paged` are the blocks the planner may page, not a plan;
    they leave the VRAM checks (the planner pages what does not fit), and tsd's region counts only
    the frozen share of what must be paged for the rest to fit in `budget.vram_usable` (on a CPU
    device, or without a measured VRAM, nothing is paged)."""
    from .quant.auto import choose, weight_bytes  # quant imports this module
    from .quant.formats import absmax_count
    from .quant.model import quantizable_linears
    from .quant.weight import quantized_of

    work = {id(p): n for p, n in trainable}
    kind = quantize if quantize in ("int8", "nf4") else None
    if quantize == "auto":
        room = budget.vram_usable if budget is not None and device.type == "cuda" else None
        kind = choose(weight_bytes(model, quant_block_size), room, prefer)
    quantizable = {id(lin.weight) for _, _, lin in quantizable_linears(model, frozen_only=True)}
    unique: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), (t for t, _ in trainable), model.buffers()):
        unique.setdefault(id(t), t)  # each tensor once (tied weights)
    to_move = on_device = frozen = paged_bytes = paged_region = largest = 0
    cpu_regrowth = 0
    usable = budget.vram_usable if budget is not None and device.type == "cuda" else None
    if may_page and usable is None:
        paged, paged_blocks = frozenset(), ()  # "auto" pages nothing without VRAM to plan for
    sizes: dict[int, int] = {}
    for p in unique.values():
        n, where = p.numel(), p.device
        q = quantized_of(p)
        if id(p) in work:
            nbytes = n * work[id(p)]
            largest = max(largest, nbytes)
            if device.type == "cpu" and p.element_size() > work[id(p)]:
                cpu_regrowth += n * (p.element_size() - work[id(p)])
        elif q is not None:  # already quantized: its codes and scales, wherever they are
            nbytes, where = q.nbytes, q.device
        elif id(p) in quantizable and kind is not None:
            nbytes = (n if kind == "int8" else (n + 1) // 2) + 4 * absmax_count(n, quant_block_size)
        else:
            nbytes = n * p.element_size()
        sizes[id(p)] = nbytes
        if id(p) in paged:
            paged_bytes += nbytes
            if id(p) not in work:
                paged_region += nbytes
            continue
        if id(p) in quantizable and q is None and kind is None:
            frozen += nbytes  # resident, and quantize= could shrink it
        if where == device:
            on_device += nbytes
        else:
            to_move += nbytes
    blas = blas_workspaces(device)
    in_flight = sorted(sum(sizes.get(i, 0) for i in set(block)) for block in paged_blocks)
    paged_inflight = int(paged_inflight) + sum(in_flight[-2:])
    if may_page and paged_bytes:
        # What must leave the VRAM for the rest to fit; its frozen share is what tsd must hold.
        resident = to_move + on_device + largest + paged_inflight + blas
        must = min(paged_bytes, max(0, resident + paged_bytes - (usable or 0)))
        paged_region = -(-paged_region * must // paged_bytes)
    host: list[tuple[str, int]] = [("streaming buffer (unwrap(), the optimizer's save and restore)", STREAM_BUFFER)]
    if device.type == "cpu":
        host.append(("the largest gradient", largest))
        if cpu_regrowth:
            host.append(("the parameters given back in their own dtype at unwrap()", cpu_regrowth))
    return Demand(parameters=sum(p.numel() for p, _ in trainable), optimizer=optimizer, accumulate=accumulate,
                  device=str(device), weights_to_move=to_move if device.type == "cuda" else 0,
                  weights_on_device=on_device if device.type == "cuda" else to_move + on_device,
                  largest_grad=largest, weights_paged=paged_bytes, paged_region_bytes=paged_region,
                  paged_inflight=int(paged_inflight), frozen_weights=frozen, quantized=kind,
                  host_parts=tuple(host), blas_workspaces=blas)


def host_room(budget: Budget) -> Optional[int]:
    """The host memory one training process may plan to take: the node's available RAM times
    RAM_HEADROOM, shared by the node's training processes (None: not measured)."""
    if budget.ram_available is None:
        return None
    return int(budget.ram_available * RAM_HEADROOM) // max(1, budget.processes or 1)


def plan(budget: Budget, demand: Demand, moment_dtype: str = "auto", check_memory: bool = True) -> Plan:
    """Picks the moment dtype ("auto": float32 when tsd and the node's RAM can hold it, else
    bfloat16) and, with `check_memory`, raises MemoryCheckFailed (a QuotaExceeded, so a
    MemoryError) for what is certain not to fit: the optimizer's state and paged weights against
    the job's quota and tsd's pool, the resident weights and what is in flight against the free and
    the usable VRAM, and tsd's new regions plus the client's own host needs against the node's
    available RAM. The refusal names each part that does not fit, its size, and what would make
    it fit."""
    if moment_dtype != "auto" and moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"moment_dtype must be 'auto', 'float32' or 'bfloat16', not {moment_dtype!r}")
    missing = [d for d in MOMENT_DTYPES if d not in demand.optimizer]
    if missing:
        raise ValueError(f"the demand has no optimizer layout for {missing} moments")
    avail = budget.tsd_available
    if avail is None:
        raise ValueError("the budget has no quota or pool_free: measure tsd's side (tsd_budget) or pass them")
    room = host_room(budget)
    auto = moment_dtype == "auto"
    if auto:
        fp32_fits = demand.tsd_bytes("float32") <= avail and (room is None or demand.host_bytes("float32") <= room)
        moment_dtype = "float32" if fp32_fits else "bfloat16"
    out = Plan(moment_dtype=moment_dtype, state_bytes=demand.optimizer[moment_dtype].state_bytes, available=avail,
               budget=budget, demand=demand, host_bytes=demand.host_bytes(moment_dtype), host_room=room)
    if check_memory:
        refusals = _refusals(out, auto)
        if refusals:
            raise MemoryCheckFailed(
                "this model cannot be trained here as configured (check_memory=False skips these checks): "
                + " ".join(f"({i}) {r.message}" for i, r in enumerate(refusals, 1)), refusals)
    return out


def _refusals(p: Plan, auto: bool) -> list[Refusal]:
    """Every check of `plan()` that fails, each with its remedies."""
    b, d, md = p.budget, p.demand, p.moment_dtype
    out = []
    bf16 = md == "float32" and not auto  # "auto" already chose bf16 when fp32 did not fit
    quantizable = d.frozen_weights > 0 and d.quantized is None
    if d.tsd_bytes(md) > p.available:
        layout = d.optimizer[md]
        parts = ", ".join(f"{what} {format_bytes(n)}" for what, n in layout.parts(md))
        if d.paged_region_bytes:
            parts += f", paged frozen weights {format_bytes(d.paged_region_bytes)}"
        fix = ["start tsd with a larger --pool-size, free other jobs or pass a larger quota="]
        if bf16:
            fix.append(f"pass moment_dtype='bfloat16' (needs {format_bytes(d.tsd_bytes('bfloat16'))})")
        out.append(Refusal(
            "tsd", d.tsd_bytes(md), p.available,
            f"tsd cannot hold this model's optimizer: it needs {format_bytes(d.tsd_bytes(md))} "
            f"({d.parameters:,} parameters: {parts}); available: {format_bytes(p.available)} (the job's quota "
            f"{format_bytes(b.quota or 0)} with {format_bytes(b.job_used or 0)} used, the pool's free "
            f"{format_bytes(b.pool_free or 0)} of {format_bytes(b.pool_total or 0)}). To fit: {'; or '.join(fix)}."))
    if d.device.startswith("cuda"):
        vram_fix = ["page blocks' weights to tsd memory (param_offload='auto')"]
        if quantizable:
            vram_fix.append(f"quantize the frozen base (quantize='int8' or 'nf4'; it is {format_bytes(d.frozen_weights)})")
        inflight = f", {format_bytes(d.paged_inflight)} for paged blocks in flight" if d.paged_inflight else ""
        if d.gpu_optimizer:
            inflight += f", {format_bytes(d.gpu_optimizer)} for the optimizer's GPU share (optimizer_gpu_fraction)"
        if b.vram_free is not None and d.weights_to_move + d.largest_grad + d.paged_inflight > b.vram_free:
            need = d.weights_to_move + d.largest_grad + d.paged_inflight
            out.append(Refusal(
                "vram_free", need, b.vram_free,
                f"the model's weights do not fit on {d.device}: {format_bytes(d.weights_to_move)} to move there plus "
                f"{format_bytes(d.largest_grad)} for the largest gradient in flight{inflight}, with "
                f"{format_bytes(b.vram_free)} free ({format_bytes(d.weights_on_device)} already there). To fit: "
                f"{'; or '.join(vram_fix + ['free the device (other processes, cached tensors)'])}."))
        elif b.vram_usable is not None and d.vram_resident > b.vram_usable:
            paged = f" ({format_bytes(d.weights_paged)} of weights paged)" if d.weights_paged else ""
            blas = (f" and {format_bytes(d.blas_workspaces)} for cuBLAS's workspaces (forward's and backward's)"
                    if d.blas_workspaces else "")
            out.append(Refusal(
                "vram_usable", d.vram_resident, b.vram_usable,
                f"the model's weights do not fit in {d.device}'s usable VRAM: resident weights "
                f"{format_bytes(d.weights_to_move + d.weights_on_device)}{paged} plus {format_bytes(d.largest_grad)} for "
                f"the largest gradient in flight{inflight}{blas} need {format_bytes(d.vram_resident)}, of "
                f"{format_bytes(b.vram_usable)} usable ({int(VRAM_HEADROOM * 100)}% of the device's memory under any "
                f"per-process memory fraction), before any activation. To fit: {'; or '.join(vram_fix)}."))
    if p.host_room is not None and p.host_bytes > p.host_room:
        own = ", ".join(f"{what} {format_bytes(n)}" for what, n in d.host_parts)
        fix = ["free host memory (other processes, tsd's other jobs)"]
        if bf16:
            fix.append(f"pass moment_dtype='bfloat16' (needs {format_bytes(d.host_bytes('bfloat16'))})")
        procs = f", shared by {b.processes} training processes" if (b.processes or 1) > 1 else ""
        out.append(Refusal(
            "host", p.host_bytes, p.host_room,
            f"the node's host RAM cannot hold this run: it needs {format_bytes(p.host_bytes)} (tsd's regions for the "
            f"job {format_bytes(d.tsd_bytes(md))} ({md} moments){', the client process: ' + own if own else ''}) of "
            f"{format_bytes(p.host_room)} this process may take ({int(RAM_HEADROOM * 100)}% of the "
            f"{format_bytes(b.ram_available or 0)} available{procs}). To fit: {'; or '.join(fix)}."))
    return out


def stock_adamw_extra_bytes(params: Iterable[tuple[int, int, int]]) -> int:
    """The VRAM the switch of offload="auto" needs beyond what the offloaded run uses, for the
    parameters tsd holds, given as (numel, bytes per element now, bytes per element in the model's
    own dtype): a param_dtype= cast undone, then what the optimizer's GPU share keeps per
    parameter (gpushare.vram_cost: fp32 exp_avg, exp_avg_sq and gradient, and an fp32 master
    where the model's dtype is not fp32)."""
    return sum(n * (own - now) + vram_cost(n, own) for n, now, own in params)


def stock_adamw_fits(peak: int, extra: int, usable: Optional[int]) -> tuple[bool, str]:
    """Whether stock AdamW fits next to what the first steps used (the measured `peak` plus
    `extra`) in `usable` bytes of device memory; None (a CPU device) keeps offloading.
    Returns (fits, explanation)."""
    if usable is None:
        return False, "device is cpu: offloading stays on"
    fits = peak + extra <= usable
    return fits, (f"peak {format_bytes(peak)} + stock AdamW's gradients and moments {format_bytes(extra)} "
                  f"{'<=' if fits else '>'} usable VRAM {format_bytes(usable)}")


def activations_to_page(peak: int, usable: Optional[int], block_bytes: Sequence[int],
                        tsd_room: Optional[int] = None, excess: Optional[int] = None) -> tuple[list[int], str]:
    """`activation_offload="auto"`'s decision after the first step: which blocks' saved
    activations to page, given the step's VRAM `peak`, the `usable` VRAM (None: a CPU device, no
    VRAM to save) and the bytes each block saved (`ActivationProfiler.block_bytes`). Nothing when
    the peak fits; else the first blocks (their activations are made first and needed last) until
    what they page covers the excess, or every block that saved anything when even that falls
    short; never more than `tsd_room` bytes (what tsd can still lend the job; None: no limit).
    `excess` gives the bytes to cover instead of the peak's excess: after a first step that paged
    by itself beside a weight planner, as many as it paged (the planner answers for the rest).
    Returns (block indices, explanation)."""
    if usable is None:
        return [], "the device is the CPU: paging saves no VRAM"
    if excess is not None:
        head = (f"as many bytes as the first step paged ({format_bytes(excess)}), on the first blocks; the weight "
                f"planner refines from that step's peak")
    elif peak <= usable:
        return [], f"the first step's peak {format_bytes(peak)} fits in the usable VRAM {format_bytes(usable)}"
    else:
        excess = peak - usable
        head = (f"the first step's peak {format_bytes(peak)} exceeds the usable VRAM {format_bytes(usable)} by "
                f"{format_bytes(excess)}")
    chosen: list[int] = []
    paged = 0
    capped = False
    for i, n in enumerate(block_bytes):
        if paged >= excess:
            break
        if n <= 0:
            continue
        if tsd_room is not None and paged + n > tsd_room:
            capped = True
            break
        chosen.append(i)
        paged += n
    why = f"{head}; the chosen blocks saved {format_bytes(paged)}"
    if capped:
        why += (f" (as many blocks as the {format_bytes(tsd_room or 0)} tsd can still lend the job hold: pass a larger "
                f"quota= or start tsd with a larger --pool-size to page more)")
    elif paged < excess:
        why += (" (less than the excess, even with every block: lower the batch, use gradient checkpointing or "
                "page weights with param_offload)")
    return chosen, why


def activations_to_keep(peak: int, usable: int, chosen: Sequence[int], block_bytes: Sequence[int],
                        margin: float, recomputed: bool = False) -> tuple[list[int], list[int], str]:
    """`activation_offload="auto"`'s refinement once the memory plan has settled (activation_auto.py):
    of the paged blocks `chosen` (or the `recomputed` ones), the last ones (made last, needed first
    in backward) whose saved bytes (`block_bytes`, by block index) fit under the `usable` VRAM less
    `margin` of it with the measured `peak`, come back to the device: each adds its saved bytes to
    the peak at most (they live from its forward to its backward, the peak is between). Returns
    (the blocks still paged or recomputed, those that come back, explanation)."""
    room = usable - int(usable * margin) - peak
    back: list[int] = []
    total = 0
    for i in reversed(chosen):
        if total + block_bytes[i] > room:
            break
        back.append(i)
        total += block_bytes[i]
    back.reverse()
    returning = set(back)
    kept = [i for i in chosen if i not in returning]
    why = (f"measured peak {format_bytes(peak)} of {format_bytes(usable)} usable VRAM, {format_bytes(max(0, room))} "
           f"left less a {margin:.0%} margin")
    if back and recomputed:
        why += (f": the saved activations of blocks {block_ranges(back)} ({format_bytes(total)}) stay on the device from "
                f"now on, one forward of {len(back)} blocks less per step")
    elif back:
        why += (f": the saved activations of blocks {block_ranges(back)} ({format_bytes(total)}) stay on the device from "
                f"now on, {format_bytes(total)} less host and PCIe traffic each way per step")
    else:
        why += f": no {'recomputed' if recomputed else 'paged'} block's saved activations fit there"
    return kept, back, why


# The block planner of weight paging (param_offload="auto"), under the names TrainStream gives it here.
from .blockplan import MemoryPlanner, spread  # noqa: E402,F401
