"""Updates that overlap the next forward: the forward order and the pre-forward waits.

Without this, `optimizer.step()` waits for the daemon to update every bucket and copies every
updated parameter back before it returns, so the next forward starts only once the whole optimizer
step is done. With it (`wrap(overlap_forward=True)`; off by default):

* `ForwardOrder` watches the first step's forward: which trainable parameter is used first (by a
  torch function, seen through a `TorchFunctionMode`) and inside which module's forward. That
  order goes to tsd (`Optimizer.set_order`): the daemon then runs queued updates in it, so the
  first buckets the next forward needs are updated first.
* `UpdateWaits` keeps the buckets whose update was handed to tsd but not yet copied back
  (`defer`). A forward pre-hook on each module that owns one of them, or that first used one in
  the recorded forward, completes just that module's buckets (`complete`: wait for the bucket's
  update on the control page, then copy its parameter slot into the parameter, H2D on CUDA) right
  before the module runs. Everything else that reads a parameter or a slot completes what it
  needs through `Session.wait_updates` (state dicts, unwrap, the next gradient of the bucket, the
  switch to stock AdamW, `optimizer.synchronize()`).

Under `torch.compile` (compiled.py) the recording step runs eagerly (a TorchFunctionMode does not
survive dynamo's tracing), the wait hooks run eagerly (each compiled forward breaks its graph
before a waiting module), and installing them resets dynamo's caches.

A parameter that the recorded forward never used (one read outside any forward, or by no module)
is not deferred: `step()` waits for it and copies it as before. The copies are the same bytes at
a later time, so results are bit-identical to the non-overlapped path.

The same pre-forward point serves the weight pager (`paging.weights`): before it copies a paged
block's parameter slots to the device it must complete those buckets, with
`Session.wait_updates(buckets)`; until it does, paged buckets are never deferred.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .compiled import eager, eager_stance, forget_compiled


class _FirstUse(TorchFunctionMode):
    """Calls `seen(tensor)` for every tensor argument of every torch function while active."""

    def __init__(self, seen: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._seen(leaf)
        return func(*args, **kwargs)


class ForwardOrder:
    """Records, during the forwards of `model` until `finish()`, the order in which the trainable
    parameters (`bucket_of`: id(parameter) -> bucket) are first used, and the innermost module
    whose forward was running at that first use (None: used outside every module's forward)."""

    def __init__(self, model: nn.Module, bucket_of: dict[int, int]) -> None:
        # A TorchFunctionMode does not survive torch.compile's tracing (dynamo has been seen to
        # hand the forward wrong values under one), so while recording, compiled models and
        # functions run eagerly: one step, from wrap() to the first step(). finish() restores
        # the stance the process had.
        self._stance = eager_stance()
        self._bucket_of = bucket_of
        self.first: dict[int, Optional[nn.Module]] = {}  # bucket -> module, in order of first use
        self._stack: list[nn.Module] = []
        self._mode: Optional[_FirstUse] = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(m.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not self._stack and torch._C._current_graph_task_id() == -1:  # the outermost forward, not a recompute
            self._mode = _FirstUse(self._seen)
            self._mode.__enter__()
        self._stack.append(module)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()
        if not self._stack and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _seen(self, t: torch.Tensor) -> None:
        b = self._bucket_of.get(id(t))
        if b is not None and b not in self.first:
            self.first[b] = self._stack[-1] if self._stack else None

    def finish(self) -> list[int]:
        """Stops recording; returns the buckets used inside a module's forward, in order of first use."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stance is not None:
            torch.compiler.set_stance(**self._stance)
            self._stance = None
        if self._mode is not None:  # a forward that never returned (an exception was raised in it)
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self._stack.clear()
        return [b for b, m in self.first.items() if m is not None]


class UpdateWaits:
    """The buckets whose update tsd owes the model, and the forward pre-hooks that complete them.

    `complete_one(bucket)` (the session's) waits for one bucket's update and copies it into its
    parameter. `install(modules)` puts a pre-hook on each module (module -> its buckets) that
    completes the module's pending buckets before its forward, plus state-dict hooks that
    complete everything before a state dict is read or loaded."""

    def __init__(self, complete_one: Callable[[int], None]) -> None:
        self._complete_one = complete_one
        self.pending: dict[int, None] = {}  # insertion-ordered set of deferred buckets
        self.deferrable: frozenset[int] = frozenset()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def install(self, model: nn.Module, modules: dict[nn.Module, list[int]]) -> None:
        """Hooks `modules` (each completes its own buckets before its forward) and every module of
        `model` for state dicts; the buckets named become deferrable."""
        self.remove()
        forget_compiled()  # a model compiled earlier would read its weights without waiting (compiled.py)
        self.deferrable = frozenset(b for bs in modules.values() for b in bs)
        for m, buckets in modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(tuple(buckets)), prepend=True))
        for m in model.modules():
            self._handles.append(m.register_state_dict_pre_hook(self._all))
            self._handles.append(m.register_load_state_dict_pre_hook(self._all))

    def _pre_hook(self, buckets: tuple[int, ...]) -> Callable[..., None]:
        @eager  # traced, its test of `pending` would be decided once, when the graph was captured
        def hook(module: nn.Module, args: Any) -> None:
            if self.pending:
                self.complete(buckets)
        return hook

    def _all(self, *args: Any) -> None:
        if self.pending:
            self.complete(None)

    def defer(self, bucket: int) -> None:
        self.pending[bucket] = None

    def complete(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Completes `buckets` (None: every pending one), in the order given; others stay pending."""
        todo = list(self.pending) if buckets is None else [b for b in buckets if b in self.pending]
        for b in todo:
            self._complete_one(b)  # raises when the daemon failed (the bucket stays pending)
            self.pending.pop(b, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.deferrable = frozenset()


def stale_use_event(index: int) -> str:
    """The event line for parameter `index` getting a gradient while its update was still owed
    (it was used outside the forward the first step recorded, so no pre-hook took the update)."""
    return (f"overlap_forward: bucket {index}'s update was still pending at its next gradient (it was used outside "
            f"the forward recorded at the first step); pass overlap_forward=False to wrap() if parameters are used "
            f"outside module forwards")


def wait_modules(model: nn.Module, first: dict[int, Optional[nn.Module]], owners: dict[int, list[nn.Module]],
                 eligible: Iterable[int]) -> dict[nn.Module, list[int]]:
    """For each eligible bucket that the recorded forward used inside a module: the modules whose
    forward pre-hook completes it, namely the module running at its first use and every module that owns
    the parameter (a tied weight has several). In forward order."""
    out: dict[nn.Module, list[int]] = {}
    ok = set(eligible)
    for b, m in first.items():
        if m is None or b not in ok:
            continue
        for mod in [m, *owners.get(b, [])]:
            bs = out.setdefault(mod, [])
            if b not in bs:
                bs.append(b)
    return out


def owners_of(model: nn.Module, bucket_of: dict[int, int]) -> dict[int, list[nn.Module]]:
    """bucket -> the modules of `model` that hold the bucket's parameter directly."""
    out: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) in bucket_of:
                mods = out.setdefault(bucket_of[id(p)], [])
                if m not in mods:
                    mods.append(m)
    return out
