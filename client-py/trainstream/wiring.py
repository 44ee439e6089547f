"""`trainstream.wrap()`: the wiring. It first computes a plan without side effects, then applies it.

1. Check the options, the optimizer and the model (`_prepare`): nothing touched yet.
2. Plan (`_plan`): connect to tsd (no job yet), measure the budget (`planner`: the machine's VRAM
   and RAM, tsd's pool and the quota the job has or would get) unless one is passed in, ask the
   daemon for the optimizer's layout (`Client.plan_optimizer`, a dry run of the registration, for
   fp32 and bf16 moments), and let `planner.plan()` pick the moment dtype or refuse what cannot
   fit. `plan_wrap()` stops here and returns the plan.
3. Apply: attach the job, register the optimizer (`engine.Session` drives it from then on), cast
   working copies (`param_dtype=`), hook the gradients, and page activations into a host arena
   of the job (`memory.HostArena`, `paging.activations`), or, with activation_offload="auto",
   profile them during the first step (`TsdAdamW.step` decides then).

This module is `wiring`, not `wrap`: a submodule named `wrap` would be shadowed by (and shadow)
the function `trainstream.wrap`.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
import socket
import time
import warnings
import weakref
from typing import Any, Optional, Union

import torch

from . import allocator, gpushare, planner, resume, share_auto
from .distributed import DataParallel, check_option as check_distributed
from .client import Client
from .engine import ParamSlots, Session
from ._topology import gpu_pci_bus_id
from .errors import InvalidRequest, TsdError
from .optim import TsdAdamW
from .paging import first_step
from .paging.activations import choose_blocks, find_blocks, page_blocks, profile_blocks
from .paging.recompute import recompute_blocks
from .paging.schedule import check_depth, choose_depth
from .paging.weights import WeightPager, check_param_offload, weight_blocks
from .blockplan import MemoryPlanner, fraction_paged
from .planner import Budget, Plan
from .progress import Progress, track
from .quant.auto import apply_wrap_quantize, check_wrap_options
from .quant.weight import quantized_of
from .units import DTYPE_BYTES, block_ranges, MOMENT_DTYPES, TSD_DTYPES, format_bytes, parse_bytes, tsd_dtype

__all__ = ["wrap", "unwrap", "unwrap_session", "plan_wrap"]

_jobs = itertools.count()

# wrap()'s options and their defaults (TrainStream's names, then tsd's own).
OPTIONS: dict[str, Any] = {
    "offload": "auto", "moment_dtype": "auto", "max_grad_norm": None, "accumulation_steps": 1, "check_memory": True,
    "param_offload": "auto", "activation_offload": "auto", "quantize": None, "prefer": "exact", "quant_block_size": 64,
    "job": None, "quota": None, "socket": None, "seed": 0, "param_dtype": None, "prefetch_depth": None,
    "keep_for": None, "resume": False, "overlap_forward": False, "optimizer_gpu_fraction": 0.0,
    "expandable_segments": "auto", "clip_speculation": "auto", "activation_recompute": "auto"}
OPTIONS["distributed"] = "auto"  # data parallel over torch.distributed (distributed.py)


@dataclasses.dataclass
class _Prepared:
    """What steps 1 made of the arguments: checked options, the device, the buckets (trainable
    parameters, last registered first) and their dtypes, the blocks to page."""

    opts: dict[str, Any]
    moment_dtype: str                 # "auto", "float32" or "bfloat16"
    device: torch.device
    buckets: list[tuple[torch.nn.Parameter, int, int]]  # (param, group, index)
    dtypes: list[str]                 # tsd's name of each bucket's working dtype
    work: Optional[torch.dtype]       # param_dtype=
    groups: list[dict[str, float]]
    amsgrad: bool
    maximize: bool
    paged_blocks: Optional[tuple[Optional[str], torch.nn.ModuleList, list[int]]]
    model: torch.nn.Module
    # optimizer_gpu_fraction: the buckets whose optimizer stays on the device (set by _plan, which
    # takes them out of `buckets`), and whether tsd gets the norm bucket (clipping over both shares).
    gpu: list[tuple[torch.nn.Parameter, int, int]] = dataclasses.field(default_factory=list)
    gpu_dtypes: list[str] = dataclasses.field(default_factory=list)
    auto_share: Optional[share_auto.Pending] = None  # "auto": decided after a measured step (set by _plan)
    # activation_recompute= naming blocks: (the stack's name, the stack, the block indices).
    recompute_blocks: Optional[tuple[Optional[str], torch.nn.ModuleList, list[int]]] = None

    @property
    def norm_bucket(self) -> bool:
        # "auto" decides after a measured step (share_auto.py): the share it may make needs the bucket then.
        share = bool(self.gpu) or self.auto_share is not None
        return share and bool(self.buckets) and bool(self.opts["max_grad_norm"])

    def split(self, ids: frozenset[int]) -> None:
        """Moves the buckets of the parameters in `ids` to the GPU share."""
        keep = [i for i, (p, _, _) in enumerate(self.buckets) if id(p) not in ids]
        gone = [i for i, (p, _, _) in enumerate(self.buckets) if id(p) in ids]
        self.gpu += [self.buckets[i] for i in gone]
        self.gpu_dtypes += [self.dtypes[i] for i in gone]
        self.buckets = [self.buckets[i] for i in keep]
        self.dtypes = [self.dtypes[i] for i in keep]

    @property
    def accumulate(self) -> bool:
        return int(self.opts["accumulation_steps"]) > 1

    def request(self, moment_dtype: str) -> dict[str, Any]:
        """The registration request (also the dry run's). With the norm bucket: one more group
        (lr=0) and one fp32 element, last (gpushare.py)."""
        norm = self.norm_bucket
        return dict(groups=self.groups + ([gpushare.NORM_GROUP] if norm else []),
                    buckets=[(gi, p.numel(), d, d) for (p, gi, _), d in zip(self.buckets, self.dtypes)]
                    + ([(len(self.groups), 1, "float32", "float32")] if norm else []),
                    moment_dtype=moment_dtype, max_grad_norm=float(self.opts["max_grad_norm"] or 0.0),
                    accumulate=self.accumulate, seed=int(self.opts["seed"]), amsgrad=self.amsgrad,
                    maximize=self.maximize)


def speculates(opts: dict[str, Any]) -> bool:
    """Whether tsd may apply clipped updates before step() (wrap's clip_speculation): "auto" does,
    except for a kept job, whose resume after a crash inside a step must undo nothing."""
    if opts["clip_speculation"] != "auto":
        return bool(opts["clip_speculation"])
    return not opts["keep_for"] and not opts["resume"]  # keep_for is parsed to seconds (0: not kept)


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"wrap() got unknown options {sorted(unknown)}; it takes {sorted(OPTIONS)}")
    out = dict(OPTIONS, **options)
    check_param_offload(out["param_offload"])
    check_depth(out["prefetch_depth"])
    check_wrap_options(out)
    if out["offload"] not in (True, "auto"):
        raise ValueError(f"offload must be True or 'auto', not {out['offload']!r} (without offloading, skip wrap())")
    if out["param_dtype"] is not None:
        out["param_dtype"] = getattr(torch, tsd_dtype(out["param_dtype"], "param_dtype"))
    steps = out["accumulation_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"accumulation_steps must be a whole number >= 1 (backward passes per step()), "
                         f"not {steps!r}")
    out["accumulation_steps"] = int(steps)
    if not isinstance(out["overlap_forward"], bool):
        raise ValueError(f"overlap_forward must be True or False, not {out['overlap_forward']!r}")
    if not (out["clip_speculation"] is True or out["clip_speculation"] is False or out["clip_speculation"] == "auto"):
        raise ValueError(f"clip_speculation must be True, False or \"auto\", not {out['clip_speculation']!r}")
    mgn = out["max_grad_norm"]
    if mgn is not None and not (float(mgn) >= 0 and math.isfinite(float(mgn))):
        raise ValueError("max_grad_norm must be a finite number >= 0")
    parse_bytes(out["quota"])  # a bad size is refused before anything happens
    resume.check_options(out)
    out["optimizer_gpu_fraction"] = gpushare.check_fraction(out["optimizer_gpu_fraction"])
    out["expandable_segments"] = allocator.check_option(out["expandable_segments"])
    if out["optimizer_gpu_fraction"] != 0.0 and (out["resume"] or out["keep_for"]):
        raise ValueError("optimizer_gpu_fraction keeps part of the optimizer's state in this process, which tsd "
                         "cannot keep for a later trainer: pass optimizer_gpu_fraction=0 with resume= or keep_for=")
    check_distributed(out["distributed"])
    rec = out["activation_recompute"]
    if rec is None:
        out["activation_recompute"] = False
    elif rec == "auto" and "activation_recompute" in options and out["activation_offload"] != "auto":
        raise ValueError("activation_recompute='auto' recomputes the blocks activation_offload='auto' would keep "
                         f"paging; with activation_offload={out['activation_offload']!r} name the blocks to recompute "
                         "(True, a fraction or a list of block indices) or pass activation_recompute=False")
    return out  # a block list's form and indices are checked against the model's stack at prepare


def _collect(optimizer: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, int, int]]:
    """The trainable parameters by group, each unique tensor once (tied weights)."""
    seen: set[int] = set()
    out = []
    index = 0
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in seen and p.requires_grad:
                if p.dtype not in TSD_DTYPES:
                    raise TypeError(f"parameter {index} is {p.dtype}; tsd updates "
                                    f"{', '.join(str(d) for d in TSD_DTYPES)} parameters")
                out.append((p, gi, index))
            seen.add(id(p))
            index += 1
    return out


def _hyper(g: dict[str, Any]) -> dict[str, float]:
    b1, b2 = g["betas"]
    return {"lr": float(g["lr"]), "beta1": float(b1), "beta2": float(b2), "eps": float(g["eps"]),
            "weight_decay": float(g["weight_decay"])}


def _explicit_paged(option: Any, count: int) -> Optional[list[int]]:
    """The blocks an explicit param_offload pages (None for "auto")."""
    if option is True:
        return list(range(count))
    if isinstance(option, float):
        return fraction_paged(option, count)
    if isinstance(option, (list, tuple, set, frozenset)):
        return sorted(set(option))
    return None


def _plan_weight_paging(session: Session, model: torch.nn.Module, prep: _Prepared, budget: Budget) -> list[int]:
    """param_offload=: makes the session's WeightPager and returns the blocks to page from the start
    (before anything moves to the device). "auto" plans them from the budget with a
    blockplan.MemoryPlanner (`session.planner`), which refines the plan from the first steps."""
    found = weight_blocks(model, prep.opts["param_offload"])
    if found is None:
        if prep.opts["param_offload"] == "auto":
            session.events.append("param_offload='auto': pages nothing (the model has no repeated block stack)")
        return []
    name, blocks = found
    option = prep.opts["param_offload"]
    pager = WeightPager(model, blocks, session, trained={id(p) for p, _, _ in prep.buckets}, name=name, work=prep.work)
    pager.auto = option == "auto"
    depth = prep.opts["prefetch_depth"]
    pager.depth = depth if depth is not None else choose_depth(pager.block_bytes,
                                                               budget.vram_usable if session.cuda else None)
    session.pager = pager
    first = _explicit_paged(option, len(blocks))
    if first is not None:
        return first
    if not session.cuda or budget.vram_usable is None:
        session.events.append(f"param_offload='auto': pages nothing on {session.device} (no VRAM to plan for)")
        return []
    used = torch.cuda.memory_allocated(session.device)
    on_device = sum(_device_bytes(t) for t in itertools.chain(model.parameters(), model.buffers())
                    if t.device == session.device)
    # cuBLAS's workspaces come with the first step's first matmuls (counted twice if one ran already:
    # this first plan errs on the safe side, and the measured peaks refine it)
    fixed = max(0, used - on_device) + pager.outside_bytes() + planner.blas_workspaces(session.device)
    session.planner = MemoryPlanner(budget, pager.block_bytes, fixed_vram=fixed,
                                    inflight_bytes=pager.largest_trained_block(), depth=pager.depth,
                                    micro_batches=pager.micro_batches)
    first = sorted(session.planner.probe_paged(session.planner.initial_paged()))
    session.events.extend(session.planner.take_events())
    return first


def _device_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor takes where it is: a quantized parameter's codes and scales."""
    q = quantized_of(t)
    return q.nbytes if q is not None else t.numel() * t.element_size()


def _start_weight_paging(session: Session, opts: dict[str, Any], first: list[int]) -> None:
    """Pages the first blocks (trained weights into their parameter slots, frozen ones into a
    region of their own). An explicit choice keeps offloading on (paged weights need tsd); with
    "auto", offload="auto" decides once the plan settled (optim.maybe_switch_to_stock)."""
    pager = session.pager
    assert pager is not None
    pager.move_to(set(first))  # paging from the start: the allocator's segments too (allocator.py)
    if session.offload == "auto" and not pager.auto:
        session.offload = True  # the switch to stock AdamW would take the paged weights' slots away
    session.events.append(
        f"param_offload={opts['param_offload']!r}: the weights of blocks {block_ranges(sorted(pager.paged)) or 'none'} of "
        f"{pager.name} ({len(pager.paged)} of {len(pager.blocks)}) are paged from tsd's memory: "
        f"{format_bytes(pager.trained_paged_bytes)} trained (their parameter slots), "
        f"{format_bytes(pager.frozen_bytes)} frozen (a region of their own); prefetch depth {pager.depth}, "
        f"{format_bytes(pager.h2d_bytes_per_step)} H2D per step"
        f"{_offload_note(opts, pager.auto)}")


def _offload_note(opts: dict[str, Any], auto: bool) -> str:
    if opts["offload"] != "auto":
        return ""
    if not auto:
        return "; offload=auto keeps offloading"
    return "; offload=auto decides once the plan settled (stock AdamW only if it settles with nothing paged)"


def _bucket_bytes(bucket: tuple[torch.nn.Parameter, int, int]) -> int:
    return bucket[0].numel() * 4  # its fp32 master, written into tsd's memory


def unwrap_session(model: torch.nn.Module) -> Optional[Session]:
    """The Session of a wrapped model (None when it is not wrapped)."""
    return getattr(model, "_trainstream_session", None)


def _prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Union[str, torch.device],
             options: dict[str, Any]) -> _Prepared:
    """Step 1: checks everything that needs no daemon."""
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
    md = opts["moment_dtype"]
    if md != "auto":
        try:
            md = tsd_dtype(md, "moment_dtype")
        except ValueError:
            md = None
        if md not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be 'auto', 'float32' or 'bfloat16', not {opts['moment_dtype']!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {dev}")

    act = opts["activation_offload"]
    paged_blocks = None
    if act not in (False, None, "auto"):
        blocks_name, block_list = find_blocks(model)
        if block_list is None:
            raise ValueError("activation_offload pages the activations of the model's repeated blocks, and this model "
                             "has no nn.ModuleList of blocks; pass activation_offload=False")
        paged_blocks = (blocks_name, block_list, choose_blocks(act, len(block_list)))

    rec = opts["activation_recompute"]
    recompute = None
    if rec is not False and rec != "auto":
        blocks_name, block_list = find_blocks(model)
        if block_list is None:
            raise ValueError("activation_recompute recomputes blocks of the model's repeated stack, and this model has "
                             "no nn.ModuleList of blocks; pass activation_recompute=False")
        recompute = (blocks_name, block_list, choose_blocks(rec, len(block_list), "activation_recompute"))

    weight_blocks(model, opts["param_offload"])  # a model without a block stack is refused here
    trainable = _collect(optimizer)
    if not trainable:
        raise ValueError("the optimizer has no trainable parameters (every one has requires_grad=False)")
    buckets = list(reversed(trainable))  # last registered first: backward produces them first
    work = opts["param_dtype"]
    # The dtype of each parameter's working copy in the model (and of its gradient and slots).
    dtypes = [TSD_DTYPES[work if work is not None else p.dtype] for p, _, _ in buckets]
    return _Prepared(opts=opts, moment_dtype=md, device=dev, buckets=buckets, dtypes=dtypes, work=work,
                     groups=[_hyper(g) for g in optimizer.param_groups],
                     amsgrad=any(g.get("amsgrad", False) for g in optimizer.param_groups),
                     maximize=any(g.get("maximize", False) for g in optimizer.param_groups),
                     paged_blocks=paged_blocks, model=model, recompute_blocks=recompute)


def _job_name(opts: dict[str, Any]) -> str:
    return opts["job"] or f"trainstream-{socket.gethostname()}-{os.getpid()}-{next(_jobs)}"


def _pageable(prep: _Prepared) -> list[set[int]]:
    """For the memory check: the ids of the parameters param_offload= may keep in tsd memory
    instead of VRAM, block by block (an explicit choice's blocks; with "auto", every block, since
    the planner may page any of them). planner.model_demand sizes them (working dtype, quantized
    size)."""
    found = weight_blocks(prep.model, prep.opts["param_offload"])
    if found is None:
        return []
    _, blocks = found
    chosen = _explicit_paged(prep.opts["param_offload"], len(blocks))
    indices = range(len(blocks)) if chosen is None else chosen
    return [{id(p) for p in blocks[i].parameters()} for i in indices]


def _plan(client: Client, prep: _Prepared, job: Optional[str], budget: Optional[Budget],
          dp: Optional[DataParallel] = None) -> Plan:
    """Step 2: the budget (given fields, then measured ones) and the daemon's dry run of the
    registration, into planner.plan(). Allocates nothing. `dp`: data parallel's ranks agree on
    the GPU share (the smallest any rank chose)."""
    given = budget if budget is not None else Budget()
    quota_request = client.quota_bytes if client.attached else parse_bytes(prep.opts["quota"])
    measured = given.merged(planner.tsd_budget(client.status(), client.jobs(), job, quota_request))
    if prep.device.type == "cuda":
        measured = measured.merged(planner.measure_device(prep.device))
    measured = measured.merged(planner.measure_host())
    blocks = _pageable(prep)
    paged: set[int] = set().union(*blocks)
    trainable = [(p, DTYPE_BYTES[d]) for (p, _, _), d in zip(prep.buckets + prep.gpu, prep.dtypes + prep.gpu_dtypes)]
    demand = planner.model_demand(
        prep.model, trainable, prep.device, {},
        accumulate=prep.accumulate, quantize=prep.opts["quantize"], quant_block_size=int(prep.opts["quant_block_size"]),
        prefer=prep.opts["prefer"], budget=measured, paged=paged, paged_blocks=blocks,
        may_page=prep.opts["param_offload"] == "auto")
    # The GPU share (optimizer_gpu_fraction) first: tsd's layout is that of the rest.
    md_guess = "float32" if prep.moment_dtype == "auto" else prep.moment_dtype
    # A share's parameters have no parameter slot in tsd, so their blocks cannot be paged: the
    # share leaves out every block the pager may page (with "auto", each block on a GPU; on the
    # CPU "auto" pages nothing).
    pageable = paged if prep.device.type == "cuda" or prep.opts["param_offload"] != "auto" else set()
    option = prep.opts["optimizer_gpu_fraction"]
    room = gpushare.vram_room(measured, demand)
    if option == "auto" and dp is None and room is not None:
        # Chosen from the first settled step's measured peak (share_auto.py), not from a guess at
        # the activations: every parameter starts in tsd.
        prep.auto_share = share_auto.Pending(trainable, frozenset(pageable), md_guess)
        total = sum(p.numel() for p, _ in trainable)
        share = gpushare.ShareChoice(frozenset(), 0, total, 0, option, (
            "optimizer_gpu_fraction=auto: everything starts in tsd; the share is chosen after the first step "
            "whose memory plan settled, from its measured VRAM peak"))
    else:
        share = gpushare.choose(option, trainable, room, pageable, md_guess)
    if dp is not None:
        share = dp.agree_share(share, lambda k: gpushare.choose(option, trainable, room, pageable, md_guess, limit=k),
                               len(trainable))
    prep.split(share.ids)
    layouts = {md: client.plan_optimizer(**prep.request(md)) if prep.buckets else gpushare.EMPTY_LAYOUT
               for md in MOMENT_DTYPES}
    demand = dataclasses.replace(demand, optimizer=layouts, gpu_optimizer=share.vram_bytes)
    out = planner.plan(measured, demand, prep.moment_dtype, bool(prep.opts["check_memory"]))
    return dataclasses.replace(out, gpu_share=share)


def plan_wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Union[str, torch.device] = "cuda",
              client: Optional[Client] = None, budget: Optional[Budget] = None, **options: Any) -> Plan:
    """What `wrap()` with the same arguments would do, without doing it: the `planner.Plan`
    (moment dtype, bytes in tsd and each part of them, the budget). Raises what wrap() would
    raise before allocating (bad options, QuotaExceeded with check_memory). Creates no job,
    allocates nothing, changes neither model nor optimizer."""
    prep = _prepare(model, optimizer, device, options)
    own = client is None
    c = client if client is not None else Client(socket=prep.opts["socket"])
    try:
        job = c.job if c.attached else (prep.opts["job"] or None)
        return _plan(c, prep, job, budget)
    finally:
        if own:
            c.close()


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: Union[str, torch.device] = "cuda",
         client: Optional[Client] = None, budget: Optional[Budget] = None,
         **options: Any) -> tuple[torch.nn.Module, TsdAdamW]:
    """Moves `optimizer`'s work into tsd. Returns (model, optimizer), the optimizer a
    torch.optim.Optimizer whose step() waits for the daemon's updates and copies them back.

    Options (TrainStream's names): offload="auto" | True, moment_dtype="auto" | "float32" |
    "bfloat16", max_grad_norm=None, accumulation_steps=1, check_memory=True (refuse, before allocating
    anything, what cannot fit: trainstream.MemoryCheckFailed), activation_offload="auto" (pages
    activations only when the first step's peak exceeds the usable VRAM) | False | True | fraction |
    [block indices],
    quantize=None | "none" | "auto" | "int8" | "nf4" (frozen block weights; "auto" when they cannot
    fit in VRAM otherwise), prefer="exact" | "speed", quant_block_size=64;
    and tsd's own: job= (default trainstream-<host>-<pid>-<n>), quota= (bytes or "8GiB"),
    socket=, seed=, param_dtype= (None, or torch.bfloat16 / torch.float16: the model's trainable
    parameters become working copies in that dtype on the device while tsd keeps their fp32
    masters; unwrap() gives them back in their own dtype with the masters' values),
    param_offload="auto" (weight paging: the block planner pages blocks of the repeated stack only when
    the weights do not fit the VRAM; nothing on the CPU; offload="auto" decides once its plan settled)
    | False | True | fraction | [block indices], prefetch_depth=None
    (paged blocks copied ahead of the one in use: None chooses 1 to 3 from the VRAM) | int.
    overlap_forward=False (True: step() returns once the updates are handed to tsd; each module's
    forward waits for just its own parameters' updates, which tsd runs in forward order; the
    results are the same bits, but parameters read directly between step() and the next forward
    are the old ones until optimizer.synchronize()).
    optimizer_gpu_fraction=0.0 | float in [0, 1] | "auto" (the share of the parameters whose
    optimizer stays on the device, fp32 masters and moments updated by torch's AdamW; the ones
    whose gradients finish last first; "auto": as many as fit in the VRAM left; 1 registers
    nothing in tsd, as offload="auto" switches to; see gpushare.py).
    distributed="auto" | True | False: data parallel over torch.distributed ("auto": when a group of
    more than one rank is initialized); the ranks sharing a tsd share one optimizer in it (see
    docs/distributed.md).
    expandable_segments="auto" | True | False: the CUDA caching allocator's segments ("auto":
    expandable from the moment a VRAM budget makes tsd page weights or activations, unless
    PYTORCH_CUDA_ALLOC_CONF names expandable_segments; True: from wrap(); False: left alone; the
    setting is process-wide and switched back at unwrap(); see allocator.py).
    clip_speculation="auto" | True | False (with max_grad_norm: True lets tsd apply each update as
    its gradient arrives while the last step's norm was under 0.8x max_grad_norm, and undo and redo
    it at step() if clipping bites after all: bit-identical when it does not bite, within rounding
    when it does; False holds every update until step(), as tsd 0.4 did; "auto": True, except for a
    kept job (keep_for=, resume=), whose resume after a crash inside a step stays bit-identical).
    `budget`: a `trainstream.planner.Budget` whose set fields replace the measured ones.
    See docs/python.md."""
    t_start = time.perf_counter()
    phases: list[tuple[str, float]] = []  # wrap()'s parts and their seconds, for its event line

    def lap(what: str) -> None:
        phases.append((what, time.perf_counter() - t_start - sum(t for _, t in phases)))

    prep = _prepare(model, optimizer, device, options)
    opts, device = prep.opts, prep.device
    owns_client = client is None
    if client is None:
        client = Client(socket=opts["socket"])
    try:
        dp = DataParallel.start(opts, client)  # None unless distributed= trains data parallel
        attached = client.job if client.attached else None
        job = attached if attached is not None else (dp.job if dp is not None else _job_name(opts))
        plan = _plan(client, prep, job, budget, dp)
        lap("plan")
        # ---- from here on, the plan is applied
        quantized = apply_wrap_quantize(model, opts, plan.budget, device)
        if quantized:
            lap("quantize")
        if attached is None:
            client.attach(job, opts["quota"], keep_for=opts["keep_for"], resume=opts["resume"])
        report = None
        if opts["resume"]:
            handle, report, moment_dtype = resume.register(client, prep.request, plan.moment_dtype,
                                                           prep.moment_dtype == "auto", dp)
            plan = dataclasses.replace(plan, moment_dtype=moment_dtype)
        elif prep.buckets:
            with Progress("wrap: registering the optimizer in tsd", counted=False):
                request = prep.request(plan.moment_dtype)
                bus_id = gpu_pci_bus_id(device)  # NUMA placement in tsd (none on a CPU)
                if bus_id:
                    request["pci_bus_id"] = bus_id
                request["hold_clipped_updates"] = not speculates(opts)
                handle = dp.register(client, request) if dp is not None else client._register_optimizer(**request)
        else:
            handle = None  # optimizer_gpu_fraction=1: every update on the device, none in tsd
        lap("registration in tsd")
    except BaseException:
        if owns_client:
            client.close()
        raise

    session = Session(device, client, owns_client, opts, budget)
    if event := session.segments.at_wrap():
        session.events.append(event)
    session.param_names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    resumed = resume.start(session, client, prep.buckets, report, bool(opts["keep_for"]), dp)
    session.handle = handle
    if dp is not None:
        session.dp, session.offload = dp, True  # the node's ranks share tsd's optimizer: no switch to stock
        dp.broadcast_parameters([p for p, _, _ in prep.buckets])
    session.moment_dtype = plan.moment_dtype
    session.memory_plan = plan
    session.state_bytes = handle.state_bytes if handle is not None else 0
    work = prep.work
    share = gpushare.install(session, prep.gpu, len(prep.groups), work,
                             len(prep.buckets) if prep.norm_bucket else None)
    # Weight paging: the blocks to page are chosen before anything moves to the device.
    first_paged = _plan_weight_paging(session, model, prep, plan.budget)
    paged_params = {id(w.param) for i in first_paged for w in session.pager.blocks[i].weights} if session.pager else set()
    for b, (p, gi, index) in enumerate(track(prep.buckets, "wrap: parameters into tsd", _bucket_bytes, "bytes")):
        ps = ParamSlots(p, b, gi, index)
        ps.master, ps.grad_slot, ps.param_slot = handle.master(b), handle.grad(b), handle.param(b)
        if resumed is None:
            session.sync_master(ps)  # from the parameter in its own dtype: param_dtype= casts after this
        else:
            resume.restore_parameter(p, ps.master, ps.param_slot, resumed.bucket_steps[b] > 0)  # tsd's state wins
        if id(p) in paged_params:
            pass  # the pager writes it (cast to param_dtype) into its parameter slot: it never visits the device
        elif work is not None and p.dtype != work:
            p.data = p.data.to(device=device if device.type == "cuda" else p.device, dtype=work)
            ps.version = p._version
        ps.version = p._version
        session.params.append(ps)
        session.by_param[id(p)] = ps
    lap("parameters into tsd")
    if share is not None:
        share.build(optimizer.param_groups)
        share.hook_gradients()
        lap("GPU share")
    wrapped = TsdAdamW(optimizer, session, plan.moment_dtype)
    if resumed is None and any(len(v) for v in optimizer.state.values()):
        # An optimizer that already stepped keeps its state (torch keeps none for gradless parameters).
        wrapped.load_state_dict(optimizer.state_dict(), allow_missing=True)
    if session.pager is not None:  # after the state is loaded: it reads the parameters
        try:
            _start_weight_paging(session, opts, first_paged)
        except BaseException:
            session.release()  # the blocks paged so far come back; the job goes (QuotaExceeded for frozen weights)
            raise
    if session.pager is not None:
        lap("weight paging")
    if device.type == "cuda":
        model.to(device)  # what is not paged
    if share is not None:
        session.events.append(plan.gpu_share.why)
    wrapped_ref = weakref.ref(wrapped)

    def hook(p: torch.Tensor) -> None:
        opt = wrapped_ref()
        if opt is not None:
            session.on_grad(opt, p)

    for ps in session.params:
        ps.hook = ps.param.register_post_accumulate_grad_hook(hook)
    if prep.recompute_blocks is not None:
        name, stack, chosen = prep.recompute_blocks
        recompute_blocks(session, list(stack), chosen, why=f" ({name or 'the model'}'s, as asked)")
    session.recompute_auto = opts["activation_recompute"] == "auto"
    if prep.paged_blocks is not None:
        page_blocks(session, model, *prep.paged_blocks)
    elif opts["activation_offload"] == "auto":
        # The first step decides (TsdAdamW.step). When the weight planner pages every block in it
        # (the budget is tight), that step must fit too: it pages the activations it measures.
        tight = session.planner is not None and session.pager is not None and bool(session.pager.paged)
        profile_blocks(session, model, page=tight)
    if session.pager is not None:
        session.pager.install()  # after the activation pager's hooks: its saved-tensor hooks go on top
        first_step.install(session, model)  # a first plan paging nothing: the head's logits may not fit
        if session.planner is not None and session.pager.reset_measure is not None:
            session.pager.reset_measure()  # the first step's peak is the first measurement
    if prep.auto_share is not None and handle is not None:
        session.auto_share = prep.auto_share
        session.events.append(plan.gpu_share.why)
    elif opts["optimizer_gpu_fraction"] == "auto" and share is None:
        session.events.append(plan.gpu_share.why)  # nothing to decide: why none
    if opts["overlap_forward"] and session.offloading:
        session.start_overlap(model)  # records the first forward (its hooks run before the pagers')
    if quantized:
        session.events.append(f"quantize: the frozen block weights are {quantized} (quant_block_size={opts['quant_block_size']})")
    host = (f"host RAM {format_bytes(plan.host_bytes)} of the {format_bytes(plan.host_room)} this process may take, "
            if plan.host_room is not None else "")
    lap("to the device and hooks")
    took = (f"; took {time.perf_counter() - t_start:.1f} s (" + ", ".join(f"{w} {t:.1f}" for w, t in phases) + ")")
    session.events.append(f"wrap: {len(prep.buckets)} buckets, {plan.demand.parameters:,} parameters"
                          f"{f' ({len(prep.gpu)} tensors of them in the GPU share)' if prep.gpu else ''}, "
                          f"{plan.moment_dtype} moments, "
                          f"{'working copies in ' + TSD_DTYPES[work] + ' on ' + str(device) + ', ' if work else ''}"
                          f"{format_bytes(session.state_bytes)} in tsd (job {client.job!r}, "
                          f"{format_bytes(plan.available)} was available), {host}"
                          + (f"AdamW on {handle.threads} daemon threads ({handle.isa})" if handle is not None
                             else "no optimizer in tsd") + took)
    setattr(model, "_trainstream_session", session)
    if dp is not None:
        how = dp.finish_wrap(session)
        session.events.append(f"distributed: rank {dp.rank} of {dp.world}, rank {dp.local_rank} of {dp.local_world} "
                              f"sharing job {dp.job!r} in this node's tsd ({len(dp.nodes)} node(s)); {how}")
    return model, wrapped


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Gives the model back with its (updated) parameters on its device, removes the hooks and
    releases the job's memory in tsd. The wrapped optimizer cannot step afterwards. Parameters
    cast by param_dtype= get their own dtype back one by one, straight from tsd's memory: no
    host copy of the model or of the optimizer's state is made."""
    session = unwrap_session(model)
    if session is None:
        raise ValueError("this model is not wrapped by trainstream")
    try:
        back = _give_back_device(session, model)
        if session.pager is not None:
            session.pager.close(back)  # the paged blocks' weights come back from tsd's memory first
        if back is not None and back != session.device:
            model.to(back)  # what stayed on the device (embeddings, resident blocks, buffers)
        if session.offloading and session.handle is not None and not session.closed:
            try:
                session.idle()
                for ps in session.params:
                    if ps.bucket not in session.moved:  # moved ones: the share gives them back
                        _give_back(ps)
            except TsdError as e:
                cast = "; parameters cast by param_dtype= keep that dtype" if session.param_dtype else ""
                warnings.warn(f"trainstream.unwrap: {e}{cast}")
        if session.share is not None:
            session.share.give_back()
            session.share = None
    finally:
        session.release()
        session.closed = True
        del model._trainstream_session
    return model


def _needed_to_give_back(session: Session, model: torch.nn.Module) -> int:
    """The bytes the model needs on its device, beyond what it holds there now, to be given back
    there in its own dtypes: its paged blocks' weights (brought back, then cast) and the copy in
    its own dtype of each parameter param_dtype= cast (for the GPU share's, only where its fp32
    master is not already of that dtype: then the master itself becomes the parameter)."""
    paged = session.pager.paged_param_bytes() if session.pager is not None and not session.pager.closed else {}
    orig = {id(ps.param): ps.orig_dtype for ps in session.params if ps.bucket not in session.moved}
    need = 0
    for p in {id(p): p for p in model.parameters()}.values():
        want = orig.get(id(p), p.dtype)
        if id(p) in paged:
            need += paged[id(p)] * max(1, want.itemsize // p.dtype.itemsize)
        elif p.device == session.device and want != p.dtype:
            need += p.numel() * want.itemsize  # the working copy goes after it
    if session.share is not None:  # the GPU share's cast parameters: their master, cast, unless it is one already
        for e in session.share.entries:
            if not e.own and e.param.dtype != e.orig_dtype and e.master.dtype != e.orig_dtype:
                need += e.param.numel() * e.orig_dtype.itemsize
    return need


def _give_back_device(session: Session, model: torch.nn.Module) -> Optional[torch.device]:
    """Where unwrap() gives the model back: its device, unless what that needs
    (`_needed_to_give_back`) does not fit in the device's free memory for this process (counting
    any per-process cap, and what torch's allocator holds unused): then the CPU, with a warning (a
    model passed on the CPU because it was larger than the card goes back there). None on a device
    that is not CUDA (nothing to decide)."""
    device = session.device
    if device.type != "cuda":
        return None
    need = _needed_to_give_back(session, model)
    if need == 0:
        return device
    free = planner.device_room(device)
    if need <= planner.GIVE_BACK_SHARE * free:
        return device
    warnings.warn(f"trainstream.unwrap: the model in its own dtypes needs {format_bytes(need)} more on {device}, "
                  f"which has {format_bytes(free)} free for this process: it is given back on the CPU")
    session.events.append(f"unwrap: the model is given back on the CPU ({format_bytes(need)} more would not fit "
                          f"in the {format_bytes(free)} free on {device})")
    return torch.device("cpu")


def _give_back(ps: ParamSlots) -> None:
    """A parameter cast by param_dtype= gets its own dtype back with its fp32 master's values,
    copied straight from tsd's memory (mapped in this process) into the new tensor: on the CPU
    into the parameter's own new storage, on CUDA host-to-device, then cast on the device. No
    host copy beyond the parameter itself."""
    p = ps.param
    if p.dtype == ps.orig_dtype:
        return
    src = ps.master.view(p.shape)
    if p.device.type == "cpu":
        out = torch.empty(p.shape, dtype=ps.orig_dtype)
        out.copy_(src)
    else:
        out = src.to(p.device).to(ps.orig_dtype)
    p.data = out
