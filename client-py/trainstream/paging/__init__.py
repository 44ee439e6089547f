"""Paging: moving what autograd or the model holds on the GPU to host memory and back.

* `paging.activations`: the saved activations of chosen blocks (`wrap(activation_offload=...)`),
  into host memory lent by tsd (`trainstream.memory.HostArena`).

The weight pager (`param_offload`) comes next to it.
"""
from .activations import ActivationPager, choose_blocks, find_blocks

__all__ = ["ActivationPager", "choose_blocks", "find_blocks"]
