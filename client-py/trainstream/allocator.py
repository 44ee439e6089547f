"""wrap(expandable_segments=): the CUDA caching allocator's segments once a VRAM budget binds.

PyTorch's caching allocator cuts fixed-size segments by default and keeps them cached after their
blocks are freed. Under a budget that binds, tsd pages weights and activations, so the allocation
pattern changes between steps (the first step measures, the planner moves blocks, the first step
may page by itself) and the cached segments of one pattern do not fit the next: measured on the
H100 (Qwen2.5-1.5B, 8x512, under a 12 GiB cap), the second step ran out of VRAM with 7.7 GiB
allocated and 2.4 GiB cached but unused, while the same run with expandable segments
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) ran every step. Expandable segments grow one
mapping per stream instead, so freed memory can be reused by a block of any size.

The environment variable must be set before the process starts; `SegmentSwitch` does the same
from within a run, at the moment tsd first pages something because the budget binds, and only
where the user set nothing for it (their `PYTORCH_CUDA_ALLOC_CONF` decides). It releases the
cached fixed segments then, and switches back when the last session that switched is released.
The setting is process-wide: other models of the process get expandable segments meanwhile.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping, Optional, Union

import torch

__all__ = ["SegmentSwitch", "budget_binds", "check_option", "user_choice"]

Option = Union[bool, str]

# Sessions that switched the allocator on and are not yet released (switched back at zero).
_holders = 0


def check_option(value: object) -> Option:
    """wrap(expandable_segments=): True, False or "auto"; a clear error for anything else."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise ValueError(f"expandable_segments must be True, False or 'auto', not {value!r}: 'auto' (the default) "
                     f"switches the CUDA caching allocator to expandable segments when a VRAM budget makes tsd page, "
                     f"True switches at wrap(), False leaves the allocator as it is")


def user_choice(env: Mapping[str, str]) -> Optional[bool]:
    """What the user's allocator configuration says about expandable segments (PYTORCH_CUDA_ALLOC_CONF,
    or PYTORCH_ALLOC_CONF, which torch reads too): True or False where it names them, else None."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        m = re.search(r"(?:^|,)\s*expandable_segments\s*:\s*(\w+)", env.get(name, ""))
        if m:
            return m.group(1).lower() in ("true", "1")
    return None


def budget_binds(session: Any, why: str) -> None:
    """Where tsd starts paging because a budget binds (`why` says how): the session's switch
    decides (a session without one, a test's stand-in, has nothing to switch), and its event joins
    the session's events."""
    segments = getattr(session, "segments", None)
    event = segments.tight(why) if segments is not None else None
    if event:
        session.events.append(event)


def _set_expandable(on: bool) -> None:
    """Sets the caching allocator's expandable_segments for segments made from now on."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.8
        setter = torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{'True' if on else 'False'}")


class SegmentSwitch:
    """One session's use of the allocator setting (module docstring). `option` is wrap()'s
    expandable_segments; `cuda` whether the session's device is a GPU (nothing to do otherwise).
    `tight(why)` is called wherever tsd starts paging because a budget binds and returns the event
    to log, or None; `restore()` is called when the session is released. `setter` and `env` are the
    allocator call and the environment (tests pass their own)."""

    def __init__(self, option: Option = False, cuda: bool = False,
                 setter: Optional[Callable[[bool], None]] = None, env: Optional[Mapping[str, str]] = None,
                 release: Optional[Callable[[], None]] = None) -> None:
        self.option = check_option(option)
        self.cuda = cuda
        # looked up at each call, so that a test can watch the module's own setter
        self.setter: Callable[[bool], None] = setter if setter is not None else (lambda on: _set_expandable(on))
        self.env = os.environ if env is None else env
        self.release_cache = release if release is not None else (torch.cuda.empty_cache if cuda else (lambda: None))
        self.switched = False
        self.decided = not cuda or option is False  # nothing left to decide

    def tight(self, why: str) -> Optional[str]:
        """A budget binds (`why` says how): switches to expandable segments, once per session,
        unless the option or the user's configuration says otherwise. Returns the event to log."""
        if self.decided:
            return None
        self.decided = True
        user = user_choice(self.env)
        if user is not None:
            return (f"allocator: {why}; the CUDA caching allocator keeps expandable_segments:{user} as "
                    f"PYTORCH_CUDA_ALLOC_CONF sets it")
        return self._switch(f"allocator: {why}, so the CUDA caching allocator makes expandable segments from now on "
                            f"(fixed ones, cut for one step's pattern, fragment when paging changes it; "
                            f"wrap(expandable_segments=False) keeps them) and its cached segments were released")

    def at_wrap(self) -> Optional[str]:
        """expandable_segments=True: switches at wrap(), whatever the budget."""
        if self.option is not True or self.decided:
            return None
        self.decided = True
        return self._switch("allocator: expandable_segments=True, so the CUDA caching allocator makes expandable "
                            "segments from now on")

    def _switch(self, event: str) -> str:
        global _holders
        try:
            self.setter(True)
        except (RuntimeError, AttributeError) as e:  # a torch without the runtime setting
            return (f"allocator: could not switch to expandable segments ({e}); set "
                    f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting the process instead")
        self.switched = True
        _holders += 1
        self.release_cache()
        return event

    def restore(self) -> None:
        """Switches back to fixed segments when this was the last session holding the switch."""
        global _holders
        if not self.switched:
            return
        self.switched = False
        _holders -= 1
        if _holders == 0:
            try:
                self.setter(False)
            except (RuntimeError, AttributeError):
                pass  # it switched on, so it switches off; nothing to undo otherwise
