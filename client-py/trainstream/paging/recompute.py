"""Recomputing chosen blocks in backward instead of keeping or paging their saved activations
(`wrap(activation_recompute=...)`): gradient checkpointing, applied by tsd to blocks of the
model's repeated stack.

A recomputed block keeps only its inputs between its forward and its backward; at the start of
its backward, autograd runs its forward again (non-reentrant `torch.utils.checkpoint`, with the
RNG state of the first run, so dropout draws the same) and takes the saved tensors from that
run. The cost is one more forward of the block on the GPU; paging the same activations costs
their bytes twice over PCIe and twice through host memory, which tsd's CPU optimizer needs too.

How: a Hugging Face decoder layer (a `GradientCheckpointingLayer`) gets its own checkpointing
turned on, the layer alone (`gradient_checkpointing` and `_gradient_checkpointing_func` on the
instance; it applies in training mode, and turns off the KV cache, which a recompute would
write a second time). Any other block's class is swapped for a subclass whose `__call__` runs
the module call (its hooks included) under checkpointing, the arrangement Hugging Face's layers
have. Either way the pagers' hooks run inside the checkpointed call, as they do for a model's
own checkpointing: the weight pager brings a paged block's weights back for the recompute and
keeps them for its backward, and the activation pager leaves the block to checkpointing
(`ActivationPager._owns_saved_tensors`). A block its model already checkpoints is left as it is.
`remove()` gives every block its own class and settings back; a swapped block pickles
(`torch.save(model)`) and deep-copies as its own class. A block whose forward changes
state besides its outputs (a cache it writes) must not be recomputed: that runs twice.

Values are recomputed by the same kernels from the same inputs and weights, so a recomputed run
is bit-identical to one that keeps the activations (the tests check it, CPU and CUDA).
"""
from __future__ import annotations

import copyreg
from functools import partial
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..units import block_ranges
from .activations import in_backward

__all__ = ["Recomputer", "recompute_blocks", "recomputed", "state_in_forward", "stop_recomputing"]

_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type) -> type:
    """The class swapped in for blocks of class `cls` (one per class, made once)."""
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = super(sub, self).__call__  # type: ignore[arg-type]
        if torch.is_grad_enabled() and not in_backward():
            return checkpoint(call, *args, use_reentrant=False, **kwargs)
        return call(*args, **kwargs)  # no graph to keep (eval, no_grad), or the recompute itself

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        # Pickled (torch.save(model), copy.deepcopy) as the block's own class: the swapped one
        # bears the same name, which pickle would find to be another class, and a copy made
        # outside the session is not the session's to recompute.
        # (copyreg's own reconstructor: pickle's __newobj__ insists on the object's class.)
        reduced: tuple[Any, ...] = object.__reduce_ex__(self, protocol)  # type: ignore[assignment]
        return (getattr(copyreg, "_reconstructor"), (cls, object, None), *reduced[2:])

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__reduce_ex__": __reduce_ex__, "_tsd_recomputes": cls,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _SUBCLASSES[cls] = sub
    return sub


_HF_SETTINGS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _hf_layer(block: nn.Module) -> bool:
    """A Hugging Face layer with checkpointing of its own (transformers' GradientCheckpointingLayer)."""
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(block).__mro__)


def state_in_forward(block: nn.Module) -> str:
    """The first submodule of `block` whose training forward updates state besides its outputs,
    which a recompute would update twice ("" if none found): batch normalization's running
    statistics. (Other writes, such as a cache a custom block keeps, cannot be seen from outside.)"""
    for name, m in block.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return f"{name or 'the block'} ({type(m).__name__}: its running statistics)"
    return ""


def recomputed(block: nn.Module) -> bool:
    """Whether `block` is recomputed in backward: by tsd, or by its model's own checkpointing
    (a Hugging Face layer with `gradient_checkpointing` on)."""
    return "_tsd_recomputes" in type(block).__dict__ or bool(getattr(block, "gradient_checkpointing", False))


class Recomputer:
    """Recomputes blocks `indices` of `blocks` in backward (see the module docstring).
    `install()` swaps their classes, `remove()` swaps them back; `blocks_recomputed` lists the
    indices it swapped (a block already recomputed by its model is not among them)."""

    def __init__(self, blocks: Sequence[nn.Module], indices: Sequence[int]) -> None:
        bad = [i for i in indices if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(f"activation_recompute block indices {bad} are not in [0, {len(blocks)})")
        self.blocks = list(blocks)
        self.indices = sorted(set(indices))
        self.blocks_recomputed: list[int] = []
        self._hf: dict[int, dict[str, Any]] = {}  # Hugging Face layers: their own settings before

    def install(self) -> None:
        for i in self.indices:
            b = self.blocks[i]
            if recomputed(b):
                continue
            if _hf_layer(b):
                self._hf[i] = {k: b.__dict__[k] for k in _HF_SETTINGS if k in b.__dict__}
                b.__dict__.update(gradient_checkpointing=True,
                                  _gradient_checkpointing_func=partial(checkpoint, use_reentrant=False))
            else:
                b.__class__ = _subclass(type(b))
            self.blocks_recomputed.append(i)

    def remove(self) -> None:
        for i in self.blocks_recomputed:
            b = self.blocks[i]
            if i in self._hf:
                for k in _HF_SETTINGS:
                    b.__dict__.pop(k, None)
                b.__dict__.update(self._hf.pop(i))
                continue
            own = type(b).__dict__.get("_tsd_recomputes")
            if own is not None:
                b.__class__ = own
        self.blocks_recomputed = []


def recompute_blocks(session: Any, blocks: Sequence[nn.Module], chosen: Sequence[int], why: str = "") -> None:
    """Recomputes blocks `chosen` of `blocks` in backward from now on, beside any the session
    (`engine.Session`) recomputes already (what wrap(activation_recompute=...) installs, and
    "auto" after the first step, or after the refinement where the first decision paged); logs it
    in the session's events."""
    done = session.recompute
    _recompute_only(session, blocks, set(done.indices if done is not None else ()) | set(chosen))
    session.events.append(f"activation_recompute: blocks {block_ranges(sorted(chosen))} ({len(chosen)} of "
                          f"{len(blocks)}) are recomputed in backward, their forward's saved activations dropped{why}")


def stop_recomputing(session: Any, indices: Sequence[int], why: str = "") -> None:
    """Blocks `indices` of the session's recomputed ones keep their saved activations again from
    the next forward on (activation_recompute="auto"'s refinement, when the settled peak has room
    for them); the others stay recomputed; logs it in the session's events."""
    done = session.recompute
    if done is None:
        return
    rest = set(done.indices) - set(indices)
    _recompute_only(session, done.blocks, rest)
    session.events.append(f"activation_recompute: blocks {block_ranges(sorted(indices))} ({len(indices)} of "
                          f"{len(done.blocks)}) keep their saved activations again, {len(rest)} stay recomputed{why}")


def _recompute_only(session: Any, blocks: Sequence[nn.Module], indices: set[int]) -> None:
    """The session recomputes blocks `indices` of `blocks` from now on, and no others: its
    Recomputer (if any) gives every block back, and a new one, if any block is left, swaps those."""
    if session.recompute is not None:
        session.recompute.remove()
    session.recompute = None
    if indices:
        session.recompute = Recomputer(blocks, sorted(indices))
        session.recompute.install()
