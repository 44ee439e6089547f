"""Activation paging: the saved activations of chosen blocks go to host memory during forward and
come back during backward (`wrap(activation_offload=...)`).

Autograd keeps, for every operation of the forward pass, the tensors its backward needs ("saved
tensors"); for a transformer these are most of the training memory that is not weights. While a
paged block runs its forward, `torch.autograd.graph.saved_tensors_hooks` hands each saved tensor
to `ActivationPager.pack`, which starts a copy into a host block on a side stream and returns a
`_Page` in its place, so the GPU memory is freed as soon as the forward no longer uses the tensor
and the copy is done. In backward, the first unpack of a paged block's tensors starts the copies
back of the paged block before it (the next whose backward runs) on the side stream, so they
overlap this block's backward; `unpack` waits for its own tensor's copy on the current stream, or
copies it there when none was started (the first paged block of a backward, a tensor saved outside
a block's forward). Measured on the H100 before the copies ran ahead (1.5B, 8x512, 19 of 28
blocks paged): backward took 333 ms, with every copy back (416 MiB a block) in series with the
block's kernels.

Host blocks come from `host` (`trainstream.memory`): under `wrap()`, the session's `HostArena`,
whose regions tsd lends (CUDA-registered, charged to the job's quota, shown by `tsctl`); a pager
made on its own uses `PinnedHost` (torch's pinned allocator). A page gives its block back when
autograd drops it (after backward, or with the graph), once the last copy from it has completed.

Values are copied bit for bit and keep their strides, so a paged run computes exactly what an
unpaged one does. Kept on the device: weights (the storage of the block's own parameters and of
the model's parameters outside the block stack, and under autocast their cast copies; another
block's weight saved here would be paged, a copy like any), tensors under `min_bytes`, views that
do not cover their memory densely, and anything not on the device. A tensor saved by several operations (the normalised input of q, k and v) is paged once.
A block under gradient checkpointing (or any saved-tensor hooks active when its forward starts,
such as torch's `save_on_cpu`) is left to them: checkpointing keeps only the block's inputs and
recomputes the rest in backward, where the pager does not page either.
On `device="cpu"` the page is a plain copy: no memory is saved, but the path (host blocks
included) runs and is tested.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..allocator import budget_binds
from ..errors import QuotaExceeded, TsdError
from ..memory import HostBlock, HostMemory, PinnedHost
from ..compiled import eager, forget_compiled
from ..units import block_ranges, format_bytes

_MIN_BYTES = 1 << 20


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward (and its module hooks)
    running now is a checkpointed block's recompute, not the step's forward."""
    return torch._C._current_graph_task_id() != -1


def dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly, in some order (contiguous, or e.g. a transposed
    result of an elementwise op): then a copy with the same strides is one flat memcpy."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class _Page:
    """One saved tensor in host memory: its block, the copy, the event of the last copy that
    touched the block, and what it takes to rebuild the tensor on the device. The block goes back
    to its allocator when autograd drops the page."""

    __slots__ = ("block", "host", "event", "size", "stride", "dtype", "device", "uses", "cached", "ahead", "owner",
                 "__weakref__")

    def __init__(self, block: HostBlock, host: torch.Tensor, event: Optional[torch.cuda.Event], t: torch.Tensor) -> None:
        self.block: Optional[HostBlock] = block
        self.host: Optional[torch.Tensor] = host
        self.event: Optional[torch.cuda.Event] = event
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device
        self.uses = 1        # operations that saved this tensor (unpacks to expect)
        self.cached: Optional[torch.Tensor] = None  # back on the device, while more unpacks are expected
        self.ahead: Optional[torch.Tensor] = None   # copied back ahead of its unpack (its copy's event is `event`)
        self.owner = -1  # the index of the paged block whose forward saved it, -1: none

    def __del__(self) -> None:
        block, self.block = self.block, None
        if block is not None:
            self.host = None
            block.release(after=self.event)


def find_blocks(model: nn.Module) -> tuple[Optional[str], Optional[nn.ModuleList]]:
    """The model's repeated block stack: its largest nn.ModuleList by parameter count (the
    `layers` of a Hugging Face decoder, the `blocks` of a GPT). Returns (name, ModuleList) or
    (None, None). Counts the parameters' elements where they are: a block whose weights a
    WeightPager paged counts 0 (ask the pager for its stack then)."""
    best, best_name, best_n = None, None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_name, best_n = m, name, n
    return best_name, best


def stack_of(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of the nn.ModuleList of `model` that holds `blocks[0]` (the block stack the
    paged blocks belong to), else `blocks` themselves."""
    if blocks:
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and any(b is blocks[0] for b in m):
                return list(m)
    return list(blocks)


def choose_blocks(option: Union[bool, float, Sequence[int]], count: int, what: str = "activation_offload") -> list[int]:
    """Indices of the blocks to page for an `activation_offload` value (or to recompute, for
    `activation_recompute`: `what` names the option in errors): True (all), a fraction in (0, 1]
    (the first ceil(f * count) blocks: their activations are made first and needed last), or a
    list of block indices."""
    if option is True:
        return list(range(count))
    if isinstance(option, float) and not isinstance(option, bool):
        if not 0.0 < option <= 1.0:
            raise ValueError(f"{what} as a fraction must be in (0, 1], not {option}")
        return list(range(min(count, math.ceil(option * count))))
    if isinstance(option, (list, tuple)):
        bad = [i for i in option if not isinstance(i, int) or not 0 <= i < count]
        if bad:
            raise ValueError(f"{what} block indices {bad} are not in [0, {count}) (the model has "
                             f"{count} blocks)")
        return sorted(set(option))
    raise ValueError(f"{what} must be False, True, 'auto', a fraction in (0, 1] or a list of block "
                     f"indices, not {option!r}")


class ActivationPager:
    """Pages the saved tensors of `blocks` (modules) to host memory; see the module docstring.
    `install()` registers the module hooks, `remove()` takes them away. `paged_bytes` counts the
    bytes paged out since the last `reset_stats()`. `host` is where the pages go (default:
    torch's pinned memory); it may be replaced between steps."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], device: Union[str, torch.device],
                 min_bytes: int = _MIN_BYTES, host: Optional[HostMemory] = None) -> None:
        self.model = model
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.min_bytes = int(min_bytes)
        self.host: HostMemory = host if host is not None else PinnedHost(pin=self.cuda)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        # The saved_tensors_hooks contexts of blocks running forward (None under no_grad).
        self.hook_ctx: list[Optional[torch.autograd.graph.saved_tensors_hooks]] = []
        # (ptr, version, dtype, shape, stride) -> (tensor, page): dedup within a block's forward.
        self.current: dict[tuple, tuple[torch.Tensor, _Page]] = {}
        self.keep_ptrs: set[int] = set()            # storages of the parameters: never paged
        self.keep_shapes: set[tuple[int, ...]] = set()  # under autocast, weights' cast copies stay too
        # The stack the blocks belong to, and what the model's parameters outside it keep (storage
        # pointers, shapes), as of the first or last paged block's forward: see _enter.
        self.stack = stack_of(model, self.blocks)
        self.outside_keep: Optional[tuple[set[int], set[tuple[int, ...]]]] = None
        self.outside_looks = 0  # how many times the model's parameters were walked (a test reads it)
        self.paged_bytes = 0
        self.paged_tensors = 0
        # The pages each paged block's last forward made (weak: autograd owns them), for the copies
        # back started ahead of that block's backward; the block whose pages were last unpacked.
        self._index = {id(b): i for i, b in enumerate(self.blocks)}
        self.block_pages: list[list[weakref.ref[_Page]]] = [[] for _ in self.blocks]
        self._owners: list[int] = []  # the paged blocks running forward (nested: the innermost last)
        self._unpacking = -1
        self.prefetched_tensors = 0  # copies back started ahead of their unpack (a test reads it)

    # ---- hooks
    def install(self) -> None:
        # Under torch.compile the hooks run eagerly around each block's compiled forward, whose saved
        # tensors the pack hook then sees; code compiled before them would page nothing (compiled.py).
        forget_compiled()
        enter, leave = eager(self._enter), eager(self._exit)
        for blk in self.blocks:
            self.handles.append(blk.register_forward_pre_hook(enter))
            self.handles.append(blk.register_forward_hook(leave, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.hook_ctx:  # only if a block's forward is still running (an exception)
            ctx = self.hook_ctx.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        self.current.clear()

    def reset_stats(self) -> None:
        self.paged_bytes = self.paged_tensors = 0

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or not self._owns_saved_tensors():
            self.hook_ctx.append(None)
            return
        # Parameters can be replaced between steps (param_dtype=, .to()), and a weight-paged
        # block's move during forward: this block's own are looked at each time, the model's
        # parameters outside the stack (embeddings, final norm, head: never paged) at the first
        # and the last paged block (the first of a forward and the first a checkpointed backward
        # recomputes). Walking every parameter at every block cost 20 ms a forward of
        # a 1.5B model on the thread that launches the kernels. Looks run with torch functions off:
        # a look is not a use (overlap_forward's ForwardOrder records uses through a
        # TorchFunctionMode, and would put every parameter into this block).
        with torch._C.DisableTorchFunction():
            if self.outside_keep is None or module is self.blocks[0] or module is self.blocks[-1]:
                self.outside_keep = self._outside_keep()
            own = list(module.parameters())
            self.keep_ptrs = self.outside_keep[0] | {p.untyped_storage().data_ptr() for p in own}
            self.keep_shapes = self.outside_keep[1] | {tuple(p.shape) for p in own}
        i = self._index.get(id(module), -1)
        if i >= 0:
            self.block_pages[i] = []  # a new forward of the block (or its recomputation)
        self._owners.append(i)
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self.hook_ctx.append(ctx)

    @staticmethod
    def _owns_saved_tensors() -> bool:
        """Whether the block starting its forward now keeps its saved tensors the usual way, so the
        pager may take them: not when saved-tensor hooks are already active (gradient
        checkpointing around the block, whose non-reentrant form keeps only the block's inputs and
        recomputes the rest; torch's `save_on_cpu`), and not in a recompute during backward
        (reentrant checkpointing), whose tensors its backward uses at once. Pushing the pager's
        hooks over checkpointing's took the tensors it drops: measured on the CPU, the blocks then
        ran once a step instead of twice, every saved tensor kept."""
        return not in_backward() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None

    def _outside_keep(self) -> tuple[set[int], set[tuple[int, ...]]]:
        """The storage pointers and shapes of the model's parameters outside the block stack."""
        self.outside_looks += 1
        inside = {id(p) for blk in self.stack for p in blk.parameters()}
        outside = [p for p in self.model.parameters() if id(p) not in inside]
        return {p.untyped_storage().data_ptr() for p in outside}, {tuple(p.shape) for p in outside}

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self.hook_ctx.pop() if self.hook_ctx else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
            if self._owners:
                self._owners.pop()
        if not self.hook_ctx:
            self.current.clear()  # the block's tensors may be freed now (once their copies are done)

    # ---- saved tensors
    def _keep(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.layout != torch.strided:
            return True
        if t.numel() * t.element_size() < self.min_bytes or not dense(t):
            return True
        if t.untyped_storage().data_ptr() in self.keep_ptrs:
            return True
        if torch.is_autocast_enabled(self.device.type) and tuple(t.shape) in self.keep_shapes:
            return True  # autocast's cast copy of a weight
        return False

    def pack(self, t: torch.Tensor) -> Any:
        if self._keep(t):
            return t
        key = (t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride())
        hit = self.current.get(key)
        if hit is not None:
            hit[1].uses += 1
            return hit[1]
        nbytes = t.numel() * t.element_size()
        block = self.host.alloc(nbytes)  # may raise QuotaExceeded: tsd cannot lend more
        try:
            host = block.view(t.dtype, t.size(), t.stride())  # t is dense: the same strides cover nbytes
            event = self._copy_out(t, host)
        except BaseException:
            block.release()  # nothing was queued on it (a failed copy), or the CPU copy is done
            raise
        page = _Page(block, host, event, t)
        if self._owners and self._owners[-1] >= 0:
            page.owner = self._owners[-1]
            self.block_pages[page.owner].append(weakref.ref(page))
        self.current[key] = (t, page)
        self.paged_bytes += t.numel() * t.element_size()
        self.paged_tensors += 1
        return page

    def _copy_out(self, t: torch.Tensor, host: torch.Tensor) -> Optional[torch.cuda.Event]:
        """Copies `t` into `host`: on CUDA, D2H on the side stream; returns the copy's event."""
        if not self.cuda:
            host.copy_(t.detach())
            return None
        stream = self.stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is reused only after the copy
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def unpack(self, page: Any) -> torch.Tensor:
        if not isinstance(page, _Page):
            return page
        page.uses -= 1
        if self.cuda and page.owner >= 0 and page.owner != self._unpacking:
            # The first unpack of this block's pages in this backward: the paged block before it
            # runs its backward next; its copies back start now, beside this block's kernels.
            # (A block of the list left to checkpointing has no pages: the one before it has.)
            self._unpacking = page.owner
            before = page.owner - 1
            while before >= 0 and not self.block_pages[before]:
                before -= 1
            if before >= 0:
                self._copy_ahead(before)
        out = page.cached
        if out is None and page.ahead is not None:
            out, page.ahead = page.ahead, None
            assert page.event is not None  # the copy back's
            torch.cuda.current_stream(page.device).wait_event(page.event)
        elif out is None:
            assert page.host is not None  # dropped only with the page
            if self.cuda:
                assert page.event is not None
                stream = torch.cuda.current_stream(page.device)
                stream.wait_event(page.event)
                out = torch.empty_strided(page.size, page.stride, dtype=page.dtype, device=page.device)
                out.copy_(page.host, non_blocking=True)
                page.event = torch.cuda.Event()  # the block is given back only after this copy
                page.event.record(stream)
            else:
                out = page.host.clone()
        # One copy back serves every operation that saved the tensor; the last one lets it go.
        page.cached = out if page.uses > 0 else None
        return out

    def _copy_ahead(self, i: int) -> None:
        """Starts the copies back of paged block `i`'s pages on the side stream (device memory
        from the current stream, which the side stream waits for; their events gate both the
        unpack and the host block's return)."""
        stream = self.stream
        assert stream is not None
        current = torch.cuda.current_stream(self.device)
        started = False
        for ref in self.block_pages[i]:
            page = ref()
            if page is None or page.host is None or page.cached is not None or page.ahead is not None:
                continue
            if not started:
                stream.wait_stream(current)  # the memory below may have been the current stream's
                started = True
            out = torch.empty_strided(page.size, page.stride, dtype=page.dtype, device=page.device)
            with torch.cuda.stream(stream):
                out.copy_(page.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            out.record_stream(stream)  # a page dropped before its unpack frees it only after the copy
            page.ahead, page.event = out, event
            self.prefetched_tensors += 1


class ActivationProfiler(ActivationPager):
    """`activation_offload="auto"`'s first step: measures, per block, the bytes of saved
    activations the pager would page (the same choice of tensors: dense, at least `min_bytes`, not
    weights, each once). `block_bytes[i]` is block i's largest forward (one micro-batch) so far.
    Installed and removed like the pager (it is one). With `page=False` it keeps every tensor; with
    `page=True` it also pages what it measures into `host` (a first step that must fit a tight
    budget: the weight planner pages every block's weights in it too). When `host` cannot lend more
    (tsd's quota or pool is full), the step fails with QuotaExceeded saying how much the step's
    activations need beyond what tsd lent (measured so far, the rest estimated from the blocks
    measured), and what to change; the failed forward's pages go back with its graph and the next
    step measures again. Keeping the rest on the device instead would overrun the budget the
    plan was made for: measured on the 7B under a 12 GiB cap, that ran out of VRAM in backward.

    With `limit` (bytes; the usable VRAM less the planner's margin) and `page=False`, paging starts
    by itself during the step: at each block's forward, when the memory allocated on the device,
    plus the remaining blocks' activations at the largest block's bytes so far, plus what the
    output head will take (`head_bytes`) would pass `limit`, this block and the rest page into
    the host that `make_host()` gives then (`started_at` records the block). Without it a first
    step whose activations outgrow the budget while the weights fit ran out of VRAM before
    anything was measured: Qwen2.5-1.5B at 8x512 under a 16 GiB cap did, at the loss's fp32
    logits. `allocated` reads the device's allocated bytes (a test passes its own)."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], device: Union[str, torch.device],
                 name: Optional[str] = None, min_bytes: int = _MIN_BYTES, page: bool = False,
                 host: Optional[HostMemory] = None, limit: Optional[int] = None,
                 make_host: Optional[Callable[[], HostMemory]] = None,
                 allocated: Optional[Callable[[], int]] = None) -> None:
        super().__init__(model, blocks, device, min_bytes=min_bytes, host=host)
        self.name = name
        self.paging = page
        self.limit = limit if not page else None
        self.make_host = make_host
        self.allocated = allocated or (lambda: torch.cuda.memory_allocated(self.device))
        self.started_at: Optional[int] = None  # the block where paging started by itself
        self.rows = output_rows(model) if self.limit is not None else None  # the LM head's outputs per token
        self.block_bytes = [0] * len(self.blocks)
        self._running: list[tuple[int, int]] = []  # (block, bytes so far) of the forwards running
        self._seen: dict[tuple, torch.Tensor] = {}   # what the running forward saved (counted once)
        self.forwards = 0

    def _enter(self, module: nn.Module, args: Any) -> None:
        i = self._index[id(module)]
        if self.limit is not None and not self.paging and not self._running and torch.is_grad_enabled():
            self._maybe_start(i, args)
        super()._enter(module, args)
        self._running.append((i, 0))

    def _maybe_start(self, i: int, args: Any) -> None:
        """Starts paging at block `i` when the step, kept on the device, would pass `limit`."""
        assert self.limit is not None
        rest = max(self.block_bytes) * (len(self.blocks) - i)
        need = self.allocated() + rest + head_bytes(self.rows, hidden_tokens(args[0] if args else None))
        if need <= self.limit:
            return
        if self.make_host is not None:
            self.host = self.make_host()
        self.paging = True
        self.started_at = i

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running:
            i, n = self._running.pop()
            if self.hook_ctx and self.hook_ctx[-1] is not None:
                self.block_bytes[i] = max(self.block_bytes[i], n)
                self.forwards += 1
        if not self._running:
            self._seen.clear()
        super()._exit(module, args, output)

    def pack(self, t: torch.Tensor) -> Any:
        if self._keep(t) or not self._running:
            return t
        key = (t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride())
        if key not in self._seen:
            self._seen[key] = t
            i, n = self._running[-1]
            self._running[-1] = (i, n + t.numel() * t.element_size())
        if not self.paging:
            return t
        try:
            return super().pack(t)
        except QuotaExceeded as e:
            raise QuotaExceeded(self._refusal(e, t.numel() * t.element_size()), e.code) from e

    def _refusal(self, e: QuotaExceeded, refused: int) -> str:
        """The first step's refusal of a `refused`-byte tensor: what tsd lent, what the step still
        needs (this block and the rest, at the largest block's bytes so far, less what this block
        already paged), and what to change."""
        i, n = self._running[-1]  # n counts the refused tensor
        per_block = max(max(self.block_bytes), n)
        more = max(0, per_block * (len(self.blocks) - i) - (n - refused))
        lent = getattr(self.host, "capacity_bytes", 0)
        which = ("every block" if self.started_at is None else
                 f"blocks {self.started_at}-{len(self.blocks) - 1} (the rest would not fit the VRAM budget)")
        return (f"trainstream: the first step under this VRAM budget pages the saved activations of {which} of "
                f"{self.name or 'the model'} to host memory lent by tsd, and tsd can lend no more in block {i} of "
                f"{len(self.blocks)} ({format_bytes(lent)} lent so far; about {format_bytes(per_block)} per block, "
                f"so about {format_bytes(more)} more for this step). Keeping the rest on the device would overrun the "
                f"VRAM budget the memory plan was made for. Start tsd with a --pool-size at least "
                f"{format_bytes(more)} larger (or pass a larger quota= to wrap()), or train with a smaller batch or "
                f"sequence, or with gradient checkpointing. Nothing was trained: the step can be run again. "
                f"tsd said: {e}")


# Bytes per logit the output head and the loss hold at once: the logits in bf16 (autocast) and the
# loss's fp32 copy and log-softmax (Hugging Face's ForCausalLMLoss upcasts before cross_entropy).
HEAD_BYTES_PER_LOGIT = 10


def output_rows(model: nn.Module) -> Optional[int]:
    """The outputs per token of the model's output embedding (`get_output_embeddings()`, a
    language model's head: its vocabulary), or None where it has none."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        head = None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return int(weight.shape[0])


def head_bytes(rows: Optional[int], tokens: int) -> int:
    """What the output head and the loss will take beyond the blocks for `tokens` tokens: tokens
    x the head's outputs (`rows`, `output_rows`'s; None: no head, 0) x HEAD_BYTES_PER_LOGIT. At
    8x512 tokens and Qwen2's 151,936-word vocabulary that is 5.8 GiB, a third of the step."""
    return 0 if rows is None else tokens * rows * HEAD_BYTES_PER_LOGIT


def hidden_tokens(hidden: Any) -> int:
    """The tokens of a block's input `hidden` (batch..., width); 0 where it is not such a tensor."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return 0
    return hidden.numel() // hidden.shape[-1]


def page_blocks(session: Any, model: nn.Module, name: Optional[str], block_list: Union[nn.ModuleList, Sequence[nn.Module]],
                chosen: Sequence[int], why: str = "", min_bytes: int = _MIN_BYTES) -> None:
    """Pages the saved activations of blocks `chosen` of `block_list` into a host arena of the
    session's job (what wrap(activation_offload=...) installs, and "auto" after its first step),
    tensors of at least `min_bytes`. `session` is the wrapped model's `engine.Session`; the
    decision is logged in its events."""
    if session.arena is None:
        session.arena = _arena(session)
    session.act_pager = ActivationPager(model, [block_list[i] for i in chosen], session.device, min_bytes=min_bytes,
                                        host=session.arena)
    session.act_pager.install()
    weights = getattr(session, "pager", None)
    if weights is not None:
        weights.reinstall()  # the weight pager's saved-tensor hooks go on top of the activation pager's
    session.events.append(f"activation_offload: the saved activations of blocks {block_ranges(list(chosen))} of "
                          f"{name or 'the model'} ({len(chosen)} of {len(block_list)}) are paged to host memory "
                          f"lent by tsd{why}")


def profile_blocks(session: Any, model: nn.Module, page: bool = False) -> None:
    """activation_offload="auto" at wrap(): on a CUDA device, installs an `ActivationProfiler` on
    the model's block stack for the first step (`TsdAdamW.step` then decides); on the CPU, or
    without a block stack, pages nothing. `page`: the first step must fit a tight budget (the
    weight planner pages every block in it), so the profiler pages what it measures, into a host
    arena of the job. Logs the decision in the session's events."""
    weights = getattr(session, "pager", None)
    blocks: Optional[list[nn.Module]]
    if weights is not None:
        # The weight pager's stack: find_blocks counts parameters, and a paged block's are empty now.
        name, blocks = weights.name, [b.module for b in weights.blocks]
    else:
        name, stack = find_blocks(model)
        blocks = list(stack) if stack is not None else None
    if blocks is None:
        session.events.append("activation_offload=auto: the model has no repeated block stack (an nn.ModuleList "
                              "of blocks); nothing paged")
        return
    if session.device.type != "cuda":
        session.events.append("activation_offload=auto: the device is the CPU, where paging saves no VRAM; "
                              "nothing paged")
        return
    arena = _arena(session) if page else None
    if arena is not None:
        session.arena = arena

    def make_host() -> HostMemory:
        budget_binds(session, "the first step pages activations to fit")  # it starts paging by itself
        if session.arena is None:
            session.arena = _arena(session)
        return session.arena

    limit = None
    if not page:
        from ..blockplan import MARGIN
        from ..planner import measure_device

        usable = session.budget.merged(measure_device(session.device)).vram_usable
        limit = None if usable is None else usable - round(usable * MARGIN)
    session.act_pager = ActivationProfiler(model, list(blocks), session.device, name=name, page=page, host=arena,
                                           limit=limit, make_host=make_host)
    session.act_pager.install()
    session.events.append(f"activation_offload=auto: measuring the saved activations of the {len(blocks)} blocks "
                          f"of {name or 'the model'} during the first step"
                          + (", paging them to host memory lent by tsd (the weight planner pages every block in "
                             "it: the budget is tight)" if page else
                             f", paging the rest from the block where the step would pass "
                             f"{format_bytes(limit)} of VRAM" if limit is not None else ""))


def trim_pages_host(session: Any, keep_bytes: int, why: str) -> None:
    """Gives the session's activation arena's regions beyond `keep_bytes` back to tsd (and the
    job's quota), when the pages a step needs have shrunk for good: the decision after the first
    step pages less than it did, or the refinement brings pages back or recomputes them. Logs it
    in the session's events; a daemon that cannot answer leaves the arena as it is."""
    arena = session.arena
    if arena is None:
        return
    try:
        freed = arena.trim(keep_bytes)
    except TsdError as e:
        session.events.append(f"activation_offload: could not give the unused host memory back to tsd ({e}); "
                              f"the arena keeps it")
        return
    if freed:
        session.events.append(f"activation_offload: {format_bytes(freed)} of host memory given back to tsd "
                              f"({why}); the arena keeps {format_bytes(getattr(arena, 'capacity_bytes', 0))} for "
                              f"{format_bytes(keep_bytes)} of pages a step")


def _arena(session: Any) -> Any:
    from ..memory import HostArena

    return HostArena(
        session.client, purpose="activation paging",
        advice="Pass a larger quota= to trainstream.wrap() (or start tsd with a larger --pool-size), page fewer "
               "blocks (activation_offload=), or train with a smaller batch")
