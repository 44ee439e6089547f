"""PCIe bandwidth between pinned host memory and the GPU, for the PCIe term of finetune_bench's
bound: host to device, device to host, and both at once (two streams), the best of --reps copies of
--mib MiB each. Prints one JSON line: h2d_gbs, d2h_gbs, both_gbs (bytes both ways over the time of
the pair), mib, reps, device.

    python3 bench/pcie_bench.py [--mib 1024] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Optional


def measure(mib: int = 1024, reps: int = 5) -> dict[str, Any]:
    """The three bandwidths in GB/s (1e9 bytes per second), each the best of `reps` timed copies."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False): run it on the GPU machine")
    n = mib << 20
    hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def best(copy: Callable[[], Any]) -> float:
        times = []
        for i in range(reps + 1):  # the first copy warms up (it is not counted)
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
        return min(times)

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            devs[0].copy_(hosts[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            hosts[1].copy_(devs[1], non_blocking=True)

    h2d = best(lambda: devs[0].copy_(hosts[0], non_blocking=True))
    d2h = best(lambda: hosts[1].copy_(devs[1], non_blocking=True))
    pair = best(both)
    return {"h2d_gbs": n / h2d / 1e9, "d2h_gbs": n / d2h / 1e9, "both_gbs": 2 * n / pair / 1e9, "mib": mib,
            "reps": reps, "device": torch.cuda.get_device_name()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB per copy (default 1024)")
    ap.add_argument("--reps", type=int, default=5, help="timed copies of each kind; the best counts (default 5)")
    a = ap.parse_args(argv)
    if a.mib < 1 or a.reps < 1:
        ap.error("--mib and --reps take integers from 1")
    try:
        print(json.dumps(measure(a.mib, a.reps)), flush=True)
    except RuntimeError as e:
        print(f"pcie_bench: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
