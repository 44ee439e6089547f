"""Paging: moving what autograd or the model holds on the GPU to host memory and back.

* `paging.activations`: the saved activations of chosen blocks (`wrap(activation_offload=...)`),
  into host memory lent by tsd (`trainstream.memory.HostArena`).
* `paging.weights`: the weights of chosen blocks (`wrap(param_offload=...)`), kept in tsd's memory
  (trained ones in their parameter slots) and copied to the device ahead of their use.
"""
from .activations import ActivationPager, choose_blocks, find_blocks
from .weights import WeightPager

__all__ = ["ActivationPager", "WeightPager", "choose_blocks", "find_blocks"]
