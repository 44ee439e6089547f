"""Weight paging: the weights of chosen blocks of the model's repeated stack live in tsd's memory
and visit the device only while a forward or a backward needs them (`wrap(param_offload=...)`).

Where a paged block's weights live (`WeightPager.page(i)`):

* a trained parameter's paged copy is its bucket's parameter slot, which tsd writes with the
  updated working weights after every step (the pager writes it once, when it pages the block):
  there is no second copy, and `finish_step()` skips the H2D copy it does for resident
  parameters;
* a frozen parameter (a LoRA base) gets a block of its own from a `HostArena` of the job (regions
  lent by tsd, charged to its quota, CUDA-registered).

How a step goes. The block in use and `depth` prefetched ones are on the device at a time:

* forward: a pre-hook on the model starts the copies of the first `depth` paged blocks (each copy
  first completes the updates tsd still owes the block's trained weights: with overlap_forward,
  `step()` defers them to here); the
  pre-hook of each block makes the compute stream wait for its copy (an event of the copy
  stream), then starts those of the next `depth` paged blocks (`wrap(prefetch_depth=)`; the
  schedule is `paging.schedule`'s); the block's post-hook frees its weights again
  (`p.data` becomes an empty tensor; `record_stream` keeps the caching allocator from reusing the
  memory before the kernels that read it are done). The last paged block stays for backward,
  which needs it first.
* While a paged block runs forward with autograd on, `saved_tensors_hooks` replace every saved
  tensor that is (a view of) one of its weights by a `_WeightRef`: the graph then holds no
  reference to the weights' memory (an addmm saves `weight.t()`, a view, which `p.data = ...`
  alone would not free). Other saved tensors go to the hooks that were active before (the
  activation pager's, gradient checkpointing's).
* backward: the first `_WeightRef` of a block unpacked (or, with gradient checkpointing, the
  block's recompute) marks the block's backward as started: paged blocks above it whose backward
  is done are freed, and the copies of the next `depth` paged blocks below start. A block recomputed by
  checkpointing stays on the device between its recompute and its backward. At the end of the
  backward, every block whose backward ran is freed; `after_step()` (from `finish_step()`) frees
  whatever is left, so no copy crosses a step (its slot has been updated since).

Each paged block crosses PCIe twice per micro-batch (once for the last paged block, kept from
its forward to its backward): `h2d_bytes_per_step` is that plan for an optimizer step,
`h2d_bytes` counts what was copied and `last_step_h2d_bytes` what the last step copied. The hooks
are in only while some block is paged: a pager that pages nothing costs nothing.

Values are copied bit for bit and keep their strides, so a paged run computes exactly what an
unpaged one does. On `device="cpu"` the copies are plain copies (no memory is saved, every path
but the streams runs and is tested).

Between uses a paged parameter is an empty tensor (`p.shape == (0,)`, no storage); the model's
`state_dict()` gives its values from tsd's memory, and its `load_state_dict()` writes them there
(the block's weights visit the device for the load). Move blocks with `page(i)` / `unpage(i)`
between steps (not between a forward and its backward).
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..allocator import budget_binds
from ..memory import HostArena, HostBlock
from ..compiled import eager, forget_compiled
from ..quant.weight import QuantizedWeight, quantized_of
from ..units import format_bytes
from . import schedule
from .activations import dense, find_blocks, in_backward
from .quantized import PagedQuantizedWeight, host_buffers, set_placeholder

if TYPE_CHECKING:
    from ..engine import ParamSlots, Session

__all__ = ["WeightPager", "weight_blocks", "check_param_offload", "REQUIREMENT"]

REQUIREMENT = ("weight paging (param_offload=) pages the weights of the model's repeated block stack: an "
               "nn.ModuleList of at least 2 blocks that run one after the other in index order (the decoder "
               "layers of a transformer, the `blocks` of a GPT)")


def check_param_offload(option: Any) -> None:
    """Refuses a malformed `param_offload` (before anything happens): False/None, True, "auto",
    a fraction in (0, 1] or a list of block indices."""
    if option is None or option is False or option is True or (isinstance(option, str) and option == "auto"):
        return
    if isinstance(option, float):
        if not (math.isfinite(option) and 0.0 < option <= 1.0):
            raise ValueError(f"param_offload as a fraction of the blocks must be in (0, 1], not {option!r}")
        return
    if isinstance(option, (list, tuple, set, frozenset)):
        bad = [i for i in option if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"param_offload block indices must be ints >= 0; got {bad}")
        return
    raise ValueError(f"param_offload must be False, True, 'auto', a fraction in (0, 1] or a list of block indices, "
                     f"not {option!r}")


def weight_blocks(model: nn.Module, option: Any) -> Optional[tuple[Optional[str], nn.ModuleList]]:
    """The block stack `param_offload=option` pages (None when it is off, or "auto" on a model
    without one); refuses a model that has none for an explicit choice, and block indices out of
    its range."""
    check_param_offload(option)
    if option is False or option is None:
        return None
    name, blocks = find_blocks(model)
    if blocks is None and isinstance(option, str):
        return None  # "auto": nothing to page in a model without a block stack (nothing needs paging either)
    if blocks is None:
        raise ValueError(f"{REQUIREMENT}, and this {type(model).__name__} has none; pass param_offload=False (the "
                         f"weights then stay on the device; param_dtype=torch.bfloat16 halves them)")
    if isinstance(option, (list, tuple, set, frozenset)):
        bad = sorted(i for i in option if i >= len(blocks))
        if bad:
            raise ValueError(f"param_offload block indices {bad} are not in [0, {len(blocks)}) (the model's "
                             f"{name or 'block stack'} has {len(blocks)} blocks)")
    return name, blocks


class _Weight:
    """One pageable parameter of a block: its shape, strides and dtype on the device, and where
    its paged copy lives (`slots`: a trained parameter's bucket; `host`: a frozen one's block)."""

    __slots__ = ("param", "name", "trained", "shape", "stride", "dtype", "slots", "block", "host")

    def __init__(self, param: nn.Parameter, name: str, trained: bool, dtype: torch.dtype) -> None:
        self.param, self.name, self.trained = param, name, trained
        self.slots: Optional["ParamSlots"] = None  # a trained parameter's, once its block is paged
        self.shape = param.shape
        self.stride = param.stride() if dense(param) else _contiguous_strides(param.shape)
        self.dtype = dtype
        self.block: Optional[HostBlock] = None
        self.host: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def source(self) -> torch.Tensor:
        """The paged copy, in the parameter's shape (row-major, as tsd's slots are)."""
        if self.slots is not None:
            return self.slots.param_slot.view(self.shape)
        assert self.host is not None
        return self.host


class _QWeight:
    """A quantized frozen parameter of a block (trainstream.quant): `paged` is its
    PagedQuantizedWeight while the block is paged."""

    __slots__ = ("param", "name", "paged")

    def __init__(self, param: nn.Parameter, name: str) -> None:
        self.param, self.name = param, name
        self.paged: Optional[PagedQuantizedWeight] = None

    @property
    def nbytes(self) -> int:
        if self.paged is not None:
            return self.paged.nbytes
        q = quantized_of(self.param)
        return q.nbytes if q is not None else 0


class _Block:
    __slots__ = ("index", "module", "weights", "quants", "paged", "loaded", "event", "waited", "bw_started", "hooks",
                 "loading")

    def __init__(self, index: int, module: nn.Module) -> None:
        self.index, self.module = index, module
        self.weights: list[_Weight] = []
        self.quants: list[_QWeight] = []
        self.paged = False
        self.loaded = False                     # a paged block's weights are on the device now
        self.event: Optional[torch.cuda.Event] = None  # the copy that brought them
        self.waited: set[int] = set()           # streams that waited for it
        self.bw_started = False
        self.hooks: list[Any] = []
        self.loading = False                    # model.load_state_dict() is writing its weights

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights) + sum(q.nbytes for q in self.quants)


class _WeightRef:
    """A saved tensor that is (a view of) a paged weight: where in the weight it lies."""

    __slots__ = ("block", "k", "size", "stride", "offset")

    def __init__(self, block: int, k: int, t: torch.Tensor, base: int) -> None:
        self.block, self.k = block, k
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - base


class _Delegated:
    """A saved tensor packed by the hooks that were active before the pager's."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self.packed, self.unpack = packed, unpack


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(list(shape)):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class WeightPager:
    """Pages the weights of `blocks` (the model's repeated stack) between the device and tsd's
    memory; see the module docstring. `paged` is the set of paged block indices, `block_bytes`
    each block's pageable bytes on the device; `page(i)` / `unpage(i)` move a block between steps;
    `close()` brings every block back and removes the hooks (unwrap() calls it).

    `trained`: the ids of the parameters tsd trains; they must be registered in `session` (their
    `ParamSlots` in `session.by_param`) before the pager pages their block. `work` is the dtype
    trained parameters have on the device (param_dtype=), None for their own. `install()` adds
    the hooks (after any activation pager's, so that its saved-tensor hooks go on top)."""

    def __init__(self, model: nn.Module, blocks: nn.ModuleList, session: "Session", trained: set[int],
                 name: Optional[str] = None, work: Optional[torch.dtype] = None, depth: int = 1) -> None:
        if schedule.check_depth(depth) is None:
            raise ValueError("depth (paged blocks prefetched ahead) must be an int, not None")
        self.model, self.session, self.name = model, session, name or "blocks"
        self.trained, self.work = set(trained), work
        self.device = session.device
        self.cuda = self.device.type == "cuda"
        self.depth = depth
        self.stream: Any = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.arena: Optional[HostArena] = None
        self.closed = False
        self.blocks = [_Block(i, m) for i, m in enumerate(blocks)]
        owners: dict[int, list[int]] = {}
        for b in self.blocks:
            for p in b.module.parameters():
                owners.setdefault(id(p), []).append(b.index)
        in_stack = {id(m) for m in blocks.modules()}
        outside = {id(p) for m in model.modules() if id(m) not in in_stack
                   for p in m._parameters.values() if p is not None}
        self.shared = 0  # parameters used by several blocks or outside the stack: they stay resident
        for b in self.blocks:
            for pname, p in b.module.named_parameters():
                if quantized_of(p) is not None and len(set(owners[id(p)])) == 1 and id(p) not in outside:
                    b.quants.append(_QWeight(p, pname))
                    continue
                if len(set(owners[id(p)])) > 1 or id(p) in outside or p.untyped_storage().nbytes() == 0:
                    self.shared += int(p.untyped_storage().nbytes() > 0)
                    continue
                is_trained = id(p) in trained
                dtype = work if (is_trained and work is not None) else p.dtype
                b.weights.append(_Weight(p, pname, is_trained, dtype))
        self._ctx: list[bool] = []      # per running block forward: whether the pager pushed hooks
        self._tasks: set[int] = set()   # graph tasks with an end-of-backward callback queued
        self._handles: list[Any] = []
        self._wanted = False            # install() was called: the hooks are in while a block is paged
        self.moves = 0                  # blocks copied to the device since the last reset_stats()
        self.moved_bytes = 0
        self.h2d_bytes = 0              # bytes of paged weights copied to the device ahead of use, ever
        self.last_step_h2d_bytes: Optional[int] = None  # those of the last optimizer step (after_step())
        self._step_mark = 0
        # ("fetch", i) / ("drop", i) events are appended here when it is a list (tests compare it
        # with schedule.simulate()).
        self.trace: Optional[list[tuple[str, int]]] = None
        self.weight_refs = 0            # saved tensors replaced by references to paged weights
        # The step's peak for the planner, and its reset: the CUDA allocator's on a GPU (None on
        # the CPU: no planning there; a test may set both).
        self.measure: Optional[Callable[[], int]] = None
        self.reset_measure: Optional[Callable[[], None]] = None
        self.highest_peak = 0           # the largest of those peaks the planner was shown since wrap()
        # param_offload="auto" made this pager: once its plan settles with nothing paged, offload="auto"
        # decides as if there were no pager (a switch to stock AdamW closes it; optim.maybe_switch_to_stock).
        self.auto = False
        if self.cuda:
            dev = self.device
            self.measure = lambda: torch.cuda.max_memory_allocated(dev)
            self.reset_measure = lambda: torch.cuda.reset_peak_memory_stats(dev)

    # ---- what is paged
    @property
    def paged(self) -> set[int]:
        return {b.index for b in self.blocks if b.paged}

    @property
    def block_bytes(self) -> list[int]:
        return [b.nbytes for b in self.blocks]

    @property
    def paged_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.paged)

    @property
    def frozen_bytes(self) -> int:
        """Bytes of frozen weights held in the pager's own region (the arena)."""
        return (sum(w.nbytes for b in self.blocks if b.paged for w in b.weights if not w.trained)
                + sum(q.nbytes for b in self.blocks if b.paged for q in b.quants
                      if q.paged is not None and q.paged.lease is not None))

    @property
    def quantized_paged_bytes(self) -> int:
        """Bytes of quantized frozen weights (codes and absmax) paged."""
        return sum(q.nbytes for b in self.blocks if b.paged for q in b.quants)

    @property
    def trained_paged_bytes(self) -> int:
        """Bytes of trained weights paged (their only copy is their parameter slot)."""
        return sum(w.nbytes for b in self.blocks if b.paged for w in b.weights if w.trained)

    def reset_stats(self) -> None:
        self.moves = self.moved_bytes = 0

    @property
    def micro_batches(self) -> int:
        """Forward and backward passes per optimizer step (the session's accumulation_steps)."""
        return max(1, int(getattr(self.session, "accumulation_steps", 1) or 1))

    @property
    def h2d_bytes_per_step(self) -> int:
        """The planned host-to-device bytes of paged weights per optimizer step with the blocks
        paged now: schedule.h2d_bytes_per_step (2 crossings per paged block and micro-batch, 1
        for the last paged block, which stays from its forward to its backward)."""
        return schedule.h2d_bytes_per_step(self.block_bytes, self.paged, self.micro_batches)

    def outside_bytes(self) -> int:
        """What the model keeps on the device outside the pageable weights (parameters and
        buffers, trained ones in their working dtype)."""
        pageable = {id(w.param) for b in self.blocks for w in b.weights} | {id(q.param) for b in self.blocks
                                                                             for q in b.quants}
        total = 0
        for p in {id(p): p for p in self.model.parameters()}.values():
            q = quantized_of(p)
            if id(p) in pageable:
                continue
            if q is not None:
                total += q.nbytes  # its codes and scales, not the placeholder's full precision
            else:
                total += p.numel() * (self.work.itemsize if (id(p) in self.trained and self.work) else p.element_size())
        total += sum(b.numel() * b.element_size() for b in self.model.buffers())
        return total

    def largest_trained_block(self) -> int:
        """The gradients of the largest block in flight at once (their bytes)."""
        return max((sum(w.nbytes for w in b.weights if w.trained) for b in self.blocks), default=0)

    def _block(self, i: Any) -> _Block:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.blocks):
            raise ValueError(f"block index must be an int in [0, {len(self.blocks)}) (the model's {self.name} has "
                             f"{len(self.blocks)} blocks), not {i!r}")
        if self.closed:
            raise RuntimeError("this weight pager was closed (the model was unwrapped)")
        return self.blocks[i]

    # ---- moving blocks between steps
    def page(self, i: int) -> bool:
        """Moves block `i`'s weights into tsd's memory (trained: their parameter slots; frozen: a
        block of the pager's arena) and frees them on the device. Between steps only. Returns
        False when it was paged already."""
        b = self._block(i)
        if b.paged:
            return False
        self._quiesce(b)
        # Every copy first; only when all of them succeeded are the device copies freed, so a
        # failure (tsd cannot lend the frozen weights' memory) leaves the block as it was.
        taken: list[HostBlock] = []
        quants: list[tuple[_QWeight, PagedQuantizedWeight]] = []
        try:
            with torch.no_grad():
                for qw in b.quants:
                    q = quantized_of(qw.param)
                    if q is None:
                        continue  # full-precision values replaced it since (a merge): it stays resident
                    quants.append((qw, self._page_quantized(i, q, taken)))
                for w in b.weights:
                    p = w.param
                    if w.trained:
                        slots = self.session.by_param.get(id(p))
                        if slots is None or slots.param_slot is None:
                            raise RuntimeError(f"parameter {w.name} of block {i} is trained but has no parameter "
                                               f"slot in tsd (the session was released?)")
                        w.slots = slots
                        w.source().copy_(p.detach())  # casts to the working dtype (param_dtype=) too
                    else:
                        if self.arena is None:
                            self.arena = self._new_arena()
                        block = self.arena.alloc(w.nbytes)
                        taken.append(block)
                        w.block, w.host = block, block.view(w.dtype, w.shape, _contiguous_strides(w.shape))
                        w.host.copy_(p.detach())
        except BaseException:
            for w in b.weights:
                w.block = w.host = None
            for block in taken:
                block.release()
            raise
        for w in b.weights:
            if w.slots is not None:
                w.slots.paged = True
            w.param.data = self._empty(w)
        for qw, pq in quants:
            qw.paged = pq
            qw.param._ts_quantized = pq  # type: ignore[attr-defined]
            set_placeholder(qw.param, pq, self.device)
        b.paged, b.loaded, b.event, b.bw_started = True, False, None, False
        if self._wanted and not self._handles:
            self._add_hooks()
        return True

    def _page_quantized(self, i: int, q: QuantizedWeight, taken: list[HostBlock]) -> PagedQuantizedWeight:
        """The paged copy of quantized weight `q` of block `i`: its own buffers when they are in
        memory tsd lent (or pinned), else a block of the arena (appended to `taken`)."""
        own = host_buffers(q)
        if own is not None:
            return PagedQuantizedWeight(self, i, q, own[0], own[1], None)
        if self.arena is None:
            self.arena = self._new_arena()
        codes, absmax = q.codes, q.absmax
        off = -(-codes.numel() // 16) * 16
        block = self.arena.alloc(off + 4 * absmax.numel())
        taken.append(block)
        hc = block.data.narrow(0, 0, codes.numel())
        ha = block.data.narrow(0, off, 4 * absmax.numel()).view(torch.float32)
        hc.copy_(codes.reshape(-1))
        ha.copy_(absmax.reshape(-1))
        return PagedQuantizedWeight(self, i, q, hc, ha, block)

    def unpage(self, i: int) -> bool:
        """Brings block `i`'s weights back to the device to stay (between steps). Returns False
        when it was resident already."""
        b = self._block(i)
        if not b.paged:
            return False
        self._quiesce(b)
        self._bring_back(b, self.device)
        if not self.paged:
            self._remove_hooks()  # nothing paged: no hook runs (param_offload="auto" on a model that fits)
        return True

    def _bring_back(self, b: _Block, target: torch.device) -> None:
        """Makes paged block `b` resident on `target` for good: its weights are loaded there, its
        trained weights' slots stop being their only copy, its frozen weights' host block goes."""
        self._drop(b)
        self._load_now(b, target)
        for w in b.weights:
            if w.slots is not None:
                w.slots.paged = False
                w.slots.version = w.param._version
            elif w.block is not None:
                w.block.release()
                w.block, w.host = None, None
        for qw in b.quants:
            pq = qw.paged
            if pq is None:
                continue
            with torch.no_grad():
                codes = pq.host_codes.to(target, copy=True)
                absmax = pq.host_absmax.to(target, copy=True)
            back = QuantizedWeight(codes, absmax, pq.kind, pq.block_size, pq.shape, pq.dtype)
            qw.param._ts_quantized = back  # type: ignore[attr-defined]
            set_placeholder(qw.param, back, target)
            # a stale reference to pq now reads the values where they are (no view of the region stays)
            pq.pager, pq.origin, pq.host_codes, pq.host_absmax = None, None, back.codes, back.absmax
            if pq.lease is not None:
                pq.lease.release()
                pq.lease = None
            qw.paged = None
        b.paged = False

    def move_to(self, paged: set[int]) -> None:
        """Pages and unpages blocks so that `paged` are the paged ones (paging out first)."""
        now = self.paged
        if paged and not now:  # the budget binds: fixed allocator segments would fragment
            budget_binds(self.session, f"the weights of {len(paged)} blocks are paged")
        for i in sorted(paged - now):
            self.page(i)
        for i in sorted(now - paged):
            self.unpage(i)

    def paged_param_bytes(self) -> dict[int, int]:
        """id(parameter) -> the bytes it takes on the device when its block is resident, for
        every parameter of a paged block (quantized ones: their codes and scales)."""
        out: dict[int, int] = {}
        for b in self.blocks:
            if b.paged:
                out.update({id(w.param): w.nbytes for w in b.weights})
                out.update({id(q.param): q.nbytes for q in b.quants})
        return out

    def close(self, target: Optional[torch.device] = None) -> None:
        """Brings every paged block back (to `target`; by default to the device when they fit in
        its free memory, else to the CPU, with a warning) and removes the hooks; the arena goes
        back to tsd."""
        if self.closed:
            return
        try:
            self._quiesce()
        except Exception:  # the daemon is gone: the slots are still mapped, with the last values
            pass
        self._remove_hooks()
        self._wanted = False
        need = self.paged_bytes
        chosen = target is not None
        target = target if target is not None else self.device
        if self.cuda and need and not chosen:
            from ..planner import GIVE_BACK_SHARE, device_room
            free = device_room(self.device)
            if need > GIVE_BACK_SHARE * free:
                target = torch.device("cpu")
                warnings.warn(f"trainstream: the paged blocks' weights ({format_bytes(need)}) do not fit in the free "
                              f"memory of {self.device} ({format_bytes(free)}): unwrap() gives them back on the CPU")
        for b in self.blocks:
            if not b.paged:
                continue
            try:
                self._bring_back(b, target)
            except torch.OutOfMemoryError:
                if target.type == "cpu":
                    raise
                target = torch.device("cpu")  # this block and the rest: the device is full after all
                warnings.warn(f"trainstream: {self.device} ran out of memory while unwrap() brought the paged blocks "
                              f"back; block {b.index} and the ones after it are given back on the CPU")
                self._bring_back(b, target)
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.closed = True

    # ---- the step
    def after_step(self) -> None:
        """From `finish_step()`: frees what is still on the device (the slots were updated), then
        lets the session's planner (param_offload="auto", or one set by hand) look at the step's
        peak and move blocks."""
        for b in self.blocks:
            if b.paged and b.loaded:
                self._drop(b)
            b.bw_started = False
            for qw in b.quants:
                if qw.paged is not None:
                    qw.paged.host_reads = False  # a state_dict() that raised half-way
        self.last_step_h2d_bytes = self.h2d_bytes - self._step_mark
        self._step_mark = self.h2d_bytes
        planner = getattr(self.session, "planner", None)
        if planner is None or self.measure is None or self.closed:
            return
        peak = self.measure()
        self.highest_peak = max(self.highest_peak, peak)
        new = planner.observe(peak, self.paged)
        self.session.events.extend(planner.take_events())
        if new is not None:
            self.move_to(set(new))
        if (not planner.done or new is not None) and self.reset_measure is not None:
            self.reset_measure()  # settled, the watchdog compares the peak since the last change

    # ---- copies
    def _new_arena(self) -> HostArena:
        client = self.session.client
        if client is None:
            raise RuntimeError("the session has no tsd client (it was released): frozen weights cannot be paged")
        return HostArena(client, purpose="paged frozen weights",
                         advice="Pass a larger quota= to trainstream.wrap() (or start tsd with a larger --pool-size), "
                                "page fewer blocks (param_offload=), or quantize the frozen base (quantize=)")

    def _empty(self, w: _Weight) -> torch.Tensor:
        return torch.empty(0, dtype=w.dtype, device=self.device)

    def _quiesce(self, b: Optional[_Block] = None) -> None:
        """No delivery in flight: tsd writes no slot while the pager reads or writes them. With a
        block `b`, only its trained weights' slots: the updates tsd owes their buckets are completed
        (so a page reads the updated weights), the others stay owed to the next forward
        (overlap_forward=True), where moving one block between steps would otherwise wait for the
        whole model's update. Data parallel, or without a block: everything (`Session.idle`)."""
        s = self.session
        if not (s.offloading and s.handle is not None and not s.closed):
            return
        if b is None or s.dp is not None:
            s.idle()
            return
        if s.cuda:
            s.side_stream.synchronize()  # every gradient copy of the step has landed
        s.raise_async()
        by = s.by_param  # a trained weight moved to the GPU share has left it: tsd owes it nothing
        buckets = sorted({by[id(w.param)].bucket for w in b.weights if w.trained and id(w.param) in by})
        s.wait_updates(buckets)
        for k in buckets:
            s.handle.wait(k)  # finished ones return at once: finish_step() took those that were not owed

    def _await_updates(self, b: _Block) -> None:
        """Completes the updates tsd still owes block `b`'s trained weights (overlap_forward defers
        them to the next forward): their slots are what the copies read."""
        s = self.session
        if s.waits.pending:
            s.wait_updates([w.slots.bucket for w in b.weights if w.trained and w.slots is not None])

    def _load_now(self, b: _Block, device: torch.device) -> None:
        """Copies block `b`'s weights to `device` on the current stream and waits (between steps)."""
        self._await_updates(b)
        with torch.no_grad(), torch.inference_mode(False):
            for w in b.weights:
                t = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=device)
                t.copy_(w.source())
                w.param.data = t
        b.loaded = False

    def _prefetch(self, b: _Block) -> None:
        """Starts copying paged block `b` to the device (on the copy stream)."""
        if not b.paged or b.loaded:
            return
        self._await_updates(b)
        with torch.no_grad(), torch.inference_mode(False):
            if self.cuda:
                stream = self.stream
                with torch.cuda.stream(stream):
                    for w in b.weights:
                        t = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=self.device)
                        t.copy_(w.source(), non_blocking=True)
                        w.param.data = t
                    for qw in b.quants:
                        self._copy_quantized(qw, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                b.event = event
                b.waited = set()
            else:
                for w in b.weights:
                    t = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=self.device)
                    t.copy_(w.source())
                    w.param.data = t
                for qw in b.quants:
                    self._copy_quantized(qw, non_blocking=False)
        b.loaded = True
        self.moves += 1
        self.moved_bytes += b.nbytes
        self.h2d_bytes += b.nbytes
        if self.trace is not None:
            self.trace.append(("fetch", b.index))

    def _copy_quantized(self, qw: _QWeight, non_blocking: bool) -> None:
        pq = qw.paged
        if pq is None:
            return
        codes = torch.empty(pq.host_codes.shape, dtype=torch.uint8, device=self.device)
        absmax = torch.empty(pq.host_absmax.shape, dtype=torch.float32, device=self.device)
        codes.copy_(pq.host_codes, non_blocking=non_blocking)
        absmax.copy_(pq.host_absmax, non_blocking=non_blocking)
        pq.dev_codes, pq.dev_absmax = codes, absmax

    def _quantized_use(self, pq: PagedQuantizedWeight) -> None:
        """A paged quantized weight's buffers are read (its layer dequantizes): in backward, its
        block's backward starts; its copy must be on the device and waited for."""
        b = self.blocks[pq.index]
        if in_backward():
            self._backward_reached(b)
        self._use(b)

    def _use(self, b: _Block) -> None:
        """Before the current stream reads block `b`'s weights: it waits for their copy, and the
        allocator learns that it uses them (so freeing them later waits for its kernels)."""
        if not b.paged:
            return
        if not b.loaded:
            self._prefetch(b)
        if self.cuda and b.event is not None:
            cur = torch.cuda.current_stream(self.device)
            if cur.cuda_stream not in b.waited:
                cur.wait_event(b.event)
                for w in b.weights:
                    w.param.data.record_stream(cur)
                for qw in b.quants:
                    if qw.paged is not None and qw.paged.dev_codes is not None and qw.paged.dev_absmax is not None:
                        qw.paged.dev_codes.record_stream(cur)
                        qw.paged.dev_absmax.record_stream(cur)
                b.waited.add(cur.cuda_stream)

    def _drop(self, b: _Block) -> None:
        if b.paged and b.loaded:
            for w in b.weights:
                w.param.data = self._empty(w)
            for qw in b.quants:
                if qw.paged is not None:
                    qw.paged.dev_codes = qw.paged.dev_absmax = None
            if self.trace is not None:
                self.trace.append(("drop", b.index))
        b.loaded, b.event, b.waited = False, None, set()

    def _prefetch_ahead(self, i: int, direction: int) -> None:
        """Starts the copies of the `depth` paged blocks after block `i` in `direction`."""
        for j in schedule.ahead(self._paged_order, i, direction, self.depth):
            self._prefetch(self.blocks[j])

    @property
    def _paged_order(self) -> list[int]:
        return [b.index for b in self.blocks if b.paged]

    # ---- hooks
    def install(self) -> None:
        """Asks for the hooks: they are in while at least one block is paged (none otherwise, so a
        run that pages nothing runs no hook)."""
        if self.closed:
            return
        self._wanted = True
        if not self._handles and any(b.paged for b in self.blocks):
            self._add_hooks()

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _add_hooks(self) -> None:
        # Under torch.compile the hooks run eagerly, a graph break at each block: they swap the
        # parameters' storage (`p.data = ...`), which a traced graph cannot hold (compiled.py).
        forget_compiled()
        self._handles.append(self.model.register_forward_pre_hook(eager(self._model_pre)))
        for b in self.blocks:
            self._handles.append(b.module.register_forward_pre_hook(self._pre_hook(b)))
            self._handles.append(b.module.register_forward_hook(self._post_hook(b), always_call=True))
            self._handles.append(b.module.register_state_dict_pre_hook(self._state_dict_pre_hook(b)))
            self._handles.append(b.module._register_state_dict_hook(self._state_dict_hook(b)))
            self._handles.append(b.module.register_load_state_dict_pre_hook(self._load_hook(b)))
            self._handles.append(b.module.register_load_state_dict_post_hook(self._loaded_hook(b)))

    def reinstall(self) -> None:
        """Registers the hooks again, after hooks installed since (an activation pager's), so the
        saved-tensor hooks this pager pushes stay on top of theirs."""
        self._remove_hooks()
        if self._wanted:
            self.install()

    def _model_pre(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self._prefetch_ahead(-1, 1)

    def _pre_hook(self, b: _Block) -> Callable[..., None]:
        @eager
        def hook(module: nn.Module, args: Any) -> None:
            backward = in_backward()
            if backward:
                self._backward_reached(b)  # a recompute (gradient checkpointing)
            if b.paged:
                self._use(b)
            if not backward:
                self._prefetch_ahead(b.index, 1)
            pushed = b.paged and torch.is_grad_enabled()
            if pushed:
                self._push_hooks(b)
            self._ctx.append(pushed)
        return hook

    def _post_hook(self, b: _Block) -> Callable[..., None]:
        @eager
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._ctx and self._ctx.pop():
                torch._C._autograd._pop_saved_tensors_default_hooks()
            if not b.paged or not b.loaded or in_backward():
                return  # resident; or a recompute: it stays for its backward
            last = max(self.paged)
            if torch.is_grad_enabled() and b.index == last:
                return  # the first block backward needs
            self._drop(b)
        return hook

    def _push_hooks(self, b: _Block) -> None:
        ptrs: dict[int, tuple[int, int]] = {}
        for k, w in enumerate(b.weights):
            st = w.param.untyped_storage()
            if st.nbytes():
                ptrs[st.data_ptr()] = (k, int(w.param.storage_offset()))
        prev = torch._C._autograd._top_saved_tensors_default_hooks(False)
        prev_pack, prev_unpack = prev if prev is not None else (None, None)
        index = b.index

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device == self.device:
                try:
                    hit = ptrs.get(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    hit = None
                if hit is not None and t.dtype == b.weights[hit[0]].dtype:
                    self.weight_refs += 1
                    return _WeightRef(index, hit[0], t, hit[1])
            if prev_pack is not None:
                return _Delegated(prev_pack(t), prev_unpack)
            return t

        torch._C._autograd._push_saved_tensors_default_hooks(pack, self._unpack)

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, _Delegated):
            return x.unpack(x.packed)
        if not isinstance(x, _WeightRef):
            return x
        b = self.blocks[x.block]
        if in_backward():
            self._backward_reached(b)
        self._use(b)
        w = b.weights[x.k].param
        return w.data.as_strided(x.size, x.stride, w.storage_offset() + x.offset)

    def _backward_reached(self, b: _Block) -> None:
        """Block `b`'s backward starts: the paged blocks above it whose backward ran are freed, its
        own copy starts if it is not on the device, then those of the `depth` paged blocks below."""
        if b.bw_started:
            return
        b.bw_started = True
        for other in self.blocks[b.index + 1:]:
            if other.paged and other.loaded and other.bw_started:
                self._drop(other)
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(task))
        if b.paged:
            self._prefetch(b)
        self._prefetch_ahead(b.index, -1)

    def _backward_done(self, task: int) -> None:
        self._tasks.discard(task)
        for b in self.blocks:
            if b.bw_started:
                self._drop(b)
                b.bw_started = False

    # ---- state_dict
    def _state_dict_pre_hook(self, b: _Block) -> Callable[..., None]:
        def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            for qw in b.quants:  # their layers save codes and absmax from tsd's memory: nothing visits the device
                if qw.paged is not None:
                    qw.paged.host_reads = True
        return hook

    def _state_dict_hook(self, b: _Block) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            for qw in b.quants:
                if qw.paged is not None:
                    qw.paged.host_reads = False
            if b.paged and not b.loaded:
                for w in b.weights:
                    if prefix + w.name in state_dict:
                        state_dict[prefix + w.name] = w.source().detach()
        return hook

    def _load_hook(self, b: _Block) -> Callable[..., None]:
        """model.load_state_dict() into a paged block: its weights come to the device for the load
        (between steps), `_loaded_hook` writes the loaded values into their paged copies."""
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
            if not b.paged or b.loading:
                return
            names = [w.name for w in b.weights]
            quants = [q.name for q in b.quants if q.paged is not None]
            if any(prefix + n in state_dict for n in quants):
                raise RuntimeError(f"block {b.index} of {self.name} is paged with quantized weights (their codes live "
                                   f"in tsd's memory): call unwrap_session(model).pager.unpage({b.index}) before "
                                   f"load_state_dict(), or load the state before trainstream.wrap()")
            if any(prefix + n in state_dict for n in names):
                self._quiesce()  # everything: the load writes the resident blocks' parameters too
                self._drop(b)
                self._load_now(b, self.device)
                b.loading = True
        return hook

    def _loaded_hook(self, b: _Block) -> Callable[..., None]:
        def hook(module: nn.Module, incompatible: Any) -> None:
            if not b.loading:
                return
            b.loading = False
            with torch.no_grad():
                for w in b.weights:
                    w.source().copy_(w.param.data)  # a trained one's slot: its master follows at its next gradient
                    w.param.data = self._empty(w)   # (the load bumped the parameter's version, as unpaged)
        return hook

    def __repr__(self) -> str:
        return (f"<trainstream WeightPager: {len(self.paged)} of {len(self.blocks)} blocks of {self.name} paged "
                f"({format_bytes(self.paged_bytes)})>")
