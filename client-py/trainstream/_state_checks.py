"""Checks of an optimizer state_dict before `TsdAdamW.load_state_dict()` writes any of it.

Every value is checked before anything is written: a refused state_dict changes nothing, neither
in tsd nor in the optimizer's param_groups. Refused, naming the parameter: a moment or master
that is not finite, a negative `exp_avg_sq` (a sum of squares: the square root of a negative one
is NaN at the next step), a `step` that is negative, not finite or not a whole number, and a
parameter with no state in a state_dict that has state for others (it belongs to another model,
or was cut; `allow_missing=True` loads such parameters as never stepped, as torch keeps them)."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

# Elements checked at once: bounds the temporary tensors a check makes.
_CHUNK = 1 << 22


def _first_bad(t: torch.Tensor, bad: Callable[[torch.Tensor], torch.Tensor]) -> Optional[int]:
    """The flat index of the first element where `bad` holds, or None (checked in chunks)."""
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        part = flat[i:i + _CHUNK]
        if not part.is_floating_point():
            part = part.to(torch.float64)
        hits = bad(part).nonzero()
        if hits.numel():
            return i + int(hits[0, 0])
    return None


def _step_value(step: Any, where: str) -> int:
    if torch.is_tensor(step):
        if step.numel() != 1:
            raise ValueError(f"{where}: 'step' has {step.numel()} elements; it must be one number")
        step = step.detach().reshape(-1)[0].item()
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise ValueError(f"{where}: 'step' is {type(step).__name__}; it must be a number")
    if not math.isfinite(step):
        raise ValueError(f"{where}: 'step' is {step}; it must be finite")
    if step < 0:
        raise ValueError(f"{where}: 'step' is {step}; it must be >= 0 (steps taken)")
    if step != int(step):
        raise ValueError(f"{where}: 'step' is {step}; it must be a whole number (steps taken)")
    return int(step)


def check_entry(st: dict[str, Any], numel: int, where: str) -> int:
    """Checks one parameter's state; returns its step. `where` names the parameter."""
    if not isinstance(st, dict):
        raise ValueError(f"{where}: its state is {type(st).__name__}, not a dict of 'step', 'exp_avg', 'exp_avg_sq'")
    missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in st]
    if missing:
        raise ValueError(f"{where}: its state lacks {missing}")
    for k in ("exp_avg", "exp_avg_sq", "master"):
        if k not in st:
            continue
        t = st[k]
        if not torch.is_tensor(t):
            raise ValueError(f"{where}: '{k}' is {type(t).__name__}, not a tensor")
        if t.numel() != numel:
            raise ValueError(f"{where}: '{k}' has {t.numel()} elements; the parameter has {numel}")
        i = _first_bad(t, lambda x: ~torch.isfinite(x))
        if i is not None:
            raise ValueError(f"{where}: '{k}' holds {t.reshape(-1)[i].item()} at flat index {i}; every value must "
                             f"be finite")
    i = _first_bad(st["exp_avg_sq"], lambda x: x < 0)
    if i is not None:
        raise ValueError(f"{where}: 'exp_avg_sq' holds {st['exp_avg_sq'].reshape(-1)[i].item()} at flat index {i}; "
                         f"it is a running mean of squared gradients and can never be negative")
    return _step_value(st["step"], where)


def check_state_dict(state: dict[int, Any], params: list[tuple[int, int, str]], allow_missing: bool) -> None:
    """Checks `state` ({index: per-parameter state}) for the trainable parameters `params`
    ((index, numel, name)); raises ValueError naming the first bad one and what was wrong."""
    present = [i for i, _, _ in params if i in state]
    for index, numel, name in params:
        where = f"the state_dict's state[{index}] (parameter {index}, {name})"
        st = state.get(index)
        if st is None:
            if present and not allow_missing:
                raise ValueError(
                    f"the state_dict has no state for parameter {index} ({name}) but has state for {len(present)} "
                    f"other parameters: it was saved for another model or cut short. If that parameter really never "
                    f"took a step, pass allow_missing=True to load it as never stepped")
            continue
        check_entry(st, numel, where)
