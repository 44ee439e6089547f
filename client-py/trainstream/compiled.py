"""TrainStream's forward hooks under `torch.compile`.

The client puts forward hooks on the user's modules: overlap_forward's waits and its recorder
(prefetch.py), the weight pager's and the activation pager's (paging/). Two properties of dynamo
matter to all of them:

* A hook dynamo traces is decided once, when the graph is captured (a test of pending updates, a
  `p.data = ...` swap, which inductor refuses as "set_ on a graph input"). `eager()` marks a hook
  `torch.compiler.disable`d: the compiled forward breaks its graph there and runs the hook eagerly
  every time. `fullgraph=True` cannot hold such a break; its error then gives `COMPILE_REASON`.
* Dynamo does not guard on a module's hooks (`torch._dynamo.config.skip_nnmodule_hook_guards`):
  code compiled before a hook existed (an evaluation before training, another instance of the
  model's class) never calls it. `forget_compiled()`, called when hooks are installed, resets
  dynamo's caches so what was compiled compiles again, with them.

`eager_stance()` runs compiled code eagerly for a while (overlap_forward's recording step, whose
TorchFunctionMode dynamo traced wrongly).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

COMPILE_REASON = ("TrainStream's forward hooks (overlap_forward's waits, weight paging) run eagerly between "
                  "compiled graphs; compile without fullgraph=True")

F = TypeVar("F", bound=Callable[..., Any])


def eager(hook: F) -> F:
    """`hook`, run eagerly under torch.compile (a graph break where it is called)."""
    return torch.compiler.disable(hook, reason=COMPILE_REASON)


def forget_compiled() -> None:
    """Resets dynamo's caches, so code compiled before hooks were added is compiled again with them."""
    torch._dynamo.reset()


def eager_stance() -> Optional[dict[str, Any]]:
    """Sets torch.compile's stance to "force_eager" and returns the one it replaced (as
    set_stance's arguments), or None where this torch has no stances."""
    try:
        from torch._dynamo.eval_frame import _stance
    except ImportError:  # a torch without compiler stances
        return None
    was = {"stance": _stance.stance, "skip_guard_eval_unsafe": _stance.skip_guard_eval_unsafe,
           "force_backend": _stance.backend}
    torch.compiler.set_stance("force_eager")
    return was
