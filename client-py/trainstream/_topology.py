"""The PCI address of a training process's GPU, which `wrap()` sends tsd with the optimizer's
registration: on a host of several NUMA nodes tsd then runs the job's optimizer threads, and
allocates its host memory, on the node that GPU is attached to (docs/daemon.md, "NUMA
placement"). A CPU device has no address."""
from __future__ import annotations

import torch


def gpu_pci_bus_id(device: torch.device) -> str:
    """"DDDD:BB:DD.0" (lower-case hex, sysfs's form) for a CUDA `device`; "" for any other
    device, or when torch does not report the address."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if not all(isinstance(v, int) and v >= 0 for v in (domain, bus, dev)):
        return ""
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"
