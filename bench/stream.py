"""Host memory traffic of a tsd step against the host's memory bandwidth (finetune_bench.py).

The CPU share of a tsd step is bound by the host's memory bandwidth: per parameter, AdamW reads
and writes the fp32 master and both moments, reads the gradient and writes the parameter slot; the
gradient's D2H copy writes host memory and the parameter's H2D copy reads it; with clipping, tsd
reads each gradient once more for its sum of squares. `host_bytes_per_param` counts those bytes
from the dtypes (the bytes tsd's kernels touch, not a sampled counter), and paging adds its own
copies (activations out and back, paged weights in). `stream_bench` (bench/stream_bench.cc) measures
the bandwidth in the same run, STREAM-style with non-temporal stores, so a report can print the
bound of a step: max(the GPU's forward and backward, host bytes per step / STREAM bandwidth).
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Optional

MASTER_BYTES = 4  # fp32 masters
NT_KERNELS = ("copy_nt_gbs", "scale_nt_gbs", "add_nt_gbs", "triad_nt_gbs")


def host_bytes_per_param(grad_bytes: int, param_bytes: int, moment_bytes: int, clip: bool) -> dict[str, int]:
    """Host memory bytes one trained parameter costs per optimizer step: `adamw` (reads and writes
    of master and moments, the gradient read, the parameter write), `clip` (the second read of the
    gradient for the norm), `pcie` (the gradient's D2H copy lands in host memory, the parameter's
    H2D copy reads it) and their `total`. E.g. bf16 gradients and parameters: 28 + 4 with fp32
    moments, 20 + 4 with bf16 ones (the figures of issue 14). fp32 parameters are their masters
    in tsd, so the update writes no parameter copy: fp32 everything is 28 + 8, not 32 + 8."""
    for name, v in (("grad_bytes", grad_bytes), ("param_bytes", param_bytes), ("moment_bytes", moment_bytes)):
        if v not in (2, 4):
            raise ValueError(f"{name} must be 2 or 4 (a 16- or 32-bit dtype), not {v!r}")
    # fp32 parameters are their masters in tsd (docs/optimizer.md): the update writes no copy.
    adamw = 2 * (MASTER_BYTES + 2 * moment_bytes) + grad_bytes + (param_bytes if param_bytes != MASTER_BYTES else 0)
    clip_read = grad_bytes if clip else 0
    pcie = grad_bytes + param_bytes
    return {"adamw": adamw, "clip": clip_read, "pcie": pcie, "total": adamw + clip_read + pcie}


def best_of(measurements: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """The run's STREAM figures for its bounds: of the measurements taken in it (None: failed),
    the one with the highest `bandwidth_gbs`, with `samples_gbs` (each measurement's, in order).
    The bound is a floor on the step's host time, so the best bandwidth the host showed in the run
    is the one to divide by: on the H100 machines one measurement moved between 97 and 175 GB/s from
    run to run, and the updates of a run measured at 111 GB/s moved 138 GB/s."""
    got = [m for m in measurements if m]
    if not got:
        return None
    best = max(got, key=lambda m: float(m["bandwidth_gbs"]))
    return {**best, "samples_gbs": [float(m["bandwidth_gbs"]) for m in got]}


def growth_per_step(samples: list[tuple[int, int]]) -> list[int]:
    """What a cumulative counter grew by each step, from (owner, count) samples taken before each
    step and after the last: `owner` names the object counting (its id()), and a step across which
    it changed (activation_offload="auto" swaps its first step's profiler for the pager after that
    step) or across which the count fell (a reset) gives nothing, rather than a difference of two
    counters. E.g. [(1, 0), (2, 0), (2, 5), (2, 10)] -> [5, 5]."""
    return [b - a for (oa, a), (ob, b) in zip(samples, samples[1:]) if oa == ob and b >= a]


def bandwidth_gbs(stream: dict[str, Any]) -> float:
    """The bandwidth a bound divides by: the best of stream_bench's non-temporal kernels (GB/s)."""
    figures = [float(stream[k]) for k in NT_KERNELS if isinstance(stream.get(k), (int, float))]
    if not figures:
        raise ValueError(f"no non-temporal STREAM figure in {sorted(stream)}")
    return max(figures)


def host_s(host_bytes_per_step: float, stream_gbs: float) -> float:
    """The host's part of a step: its traffic at STREAM speed."""
    if stream_gbs <= 0:
        raise ValueError(f"STREAM bandwidth must be > 0 GB/s, not {stream_gbs}")
    return host_bytes_per_step / (stream_gbs * 1e9)


def bound_s(forward_backward_s: float, host_bytes_per_step: float, stream_gbs: float) -> float:
    """A step's bound: the GPU's forward and backward, or the host's traffic at STREAM speed,
    whichever is longer."""
    return max(forward_backward_s, host_s(host_bytes_per_step, stream_gbs))


def pcie_s(h2d_bytes_per_step: float, d2h_bytes_per_step: float, pcie: dict[str, Any]) -> float:
    """The PCIe part of a step: its copies host to device and device to host at the bandwidths
    bench/pcie_bench.py measured (`h2d_gbs`, `d2h_gbs`), or both ways at once (`both_gbs`, the
    bytes of both directions over the time of the pair), whichever takes longest."""
    for k in ("h2d_gbs", "d2h_gbs", "both_gbs"):
        if not float(pcie.get(k) or 0) > 0:
            raise ValueError(f"PCIe bandwidth {k} must be > 0 GB/s, not {pcie.get(k)!r}")
    return max(h2d_bytes_per_step / (pcie["h2d_gbs"] * 1e9), d2h_bytes_per_step / (pcie["d2h_gbs"] * 1e9),
               (h2d_bytes_per_step + d2h_bytes_per_step) / (pcie["both_gbs"] * 1e9))


def stock_gpu_s(stock_values: list[dict[str, Any]]) -> Optional[float]:
    """The GPU part of a run's bounds from its stock records' values: the median (the upper middle
    for an even count) of stock's forward + backward where they carry them, else of its whole step
    (peers.py times only that: an upper bound of its forward and backward, which matters only where
    it exceeds the host's part); None without stock."""
    def median(xs: list[float]) -> Optional[float]:
        return sorted(xs)[len(xs) // 2] if xs else None

    fb = [(v["gpu_forward_ms"] + v["gpu_backward_ms"]) / 1e3 for v in stock_values
          if "gpu_forward_ms" in v and "gpu_backward_ms" in v]
    if fb:
        return median(fb)
    return median([v["step_s_median"] for v in stock_values if isinstance(v.get("step_s_median"), (int, float))])


def find_binary(given: Optional[str], tsd_bin: Optional[str], root: str) -> Optional[str]:
    """stream_bench: `given`, else beside the tsd binary, else root/build/bin; None when absent."""
    if given:
        return given if os.path.exists(given) else None
    dirs = [os.path.dirname(os.path.abspath(tsd_bin))] if tsd_bin else []
    dirs.append(os.path.join(root, "build", "bin"))
    for d in dirs:
        path = os.path.join(d, "stream_bench")
        if os.path.exists(path):
            return path
    return None


def measure(binary: str, threads: Optional[int] = None, array_mib: int = 512, reps: int = 5,
            timeout_s: float = 600) -> dict[str, Any]:
    """Runs stream_bench and returns its figures (GB/s per kernel, ordinary and non-temporal
    stores). RuntimeError, with what it printed, when it fails."""
    argv = [binary, "--array-mib", str(array_mib), "--reps", str(reps)]
    if threads:
        argv += ["--threads", str(threads)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv)} failed (exit status {run.returncode}): "
                           f"{(run.stderr or run.stdout).strip()[-500:]}")
    return dict(json.loads(lines[-1]))
