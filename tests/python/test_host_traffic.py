"""The host side of a step (issue 14): the host memory bytes a tsd step moves per parameter, the
STREAM measurement they are divided by, the bound finetune_bench prints, its --loader-workers
DataLoader, and the GPU's PCI address wrap() sends tsd for NUMA placement."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchlib  # noqa: E402
import stream  # noqa: E402

from trainstream._topology import gpu_pci_bus_id  # noqa: E402


def test_host_bytes_per_param_follow_the_dtypes():
    # bf16 gradients and parameters: the 28 (fp32 moments) and 20 (bf16 moments), + 4 over PCIe.
    fp32m = stream.host_bytes_per_param(2, 2, 4, clip=False)
    assert fp32m == {"adamw": 28, "clip": 0, "pcie": 4, "total": 32}
    assert stream.host_bytes_per_param(2, 2, 2, clip=False)["total"] == 24
    # Clipping reads each gradient once more; fp32 gradients and parameters cost twice as much.
    assert stream.host_bytes_per_param(2, 2, 4, clip=True)["total"] == 34
    # fp32 parameters are their masters in tsd: no parameter write in the update
    assert stream.host_bytes_per_param(4, 4, 4, clip=True) == {"adamw": 28, "clip": 4, "pcie": 8, "total": 40}
    with pytest.raises(ValueError, match="moment_bytes must be 2 or 4"):
        stream.host_bytes_per_param(2, 2, 8, clip=False)


def test_the_bound_is_the_longer_of_gpu_and_host():
    # 1.54e9 parameters at 32 bytes over 124 GB/s: the issue's ~0.40 s, longer than a 0.28 s forward+backward.
    assert stream.bound_s(0.28, 1.54e9 * 32, 124.0) == pytest.approx(0.397, abs=1e-3)
    assert stream.bound_s(0.5, 1.54e9 * 32, 124.0) == 0.5
    assert stream.bandwidth_gbs({"copy_gbs": 200.0, "copy_nt_gbs": 124.0, "triad_nt_gbs": 118.0}) == 124.0
    with pytest.raises(ValueError, match="no non-temporal STREAM figure"):
        stream.bandwidth_gbs({"copy_gbs": 77.0})
    with pytest.raises(ValueError, match="must be > 0"):
        stream.bound_s(0.1, 1e9, 0.0)


def test_a_counters_growth_per_step_skips_a_change_of_counter_and_a_reset():
    # activation_offload="auto": the first step's profiler (id 1) counts, then the pager (id 2) from
    # zero; the H100 sweep of 2026-12-07 read the profiler only and recorded no activation bytes.
    assert stream.growth_per_step([(1, 0), (1, 7), (2, 0), (2, 5), (2, 11)]) == [7, 5, 6]
    assert stream.growth_per_step([(2, 9), (2, 3), (2, 4)]) == [1]  # reset_stats() between steps
    assert stream.growth_per_step([(1, 0)]) == []


def stream_bench_binary():
    path = stream.find_binary(None, os.environ.get("TSD_BIN"), ROOT)
    if path is None:
        pytest.skip("stream_bench is not built (ninja -C build stream_bench)")
    return path


def test_stream_bench_measures_every_kernel_both_ways():
    got = stream.measure(stream_bench_binary(), threads=2, array_mib=16, reps=2)
    assert got["threads"] == 2 and got["array_mib"] == 16
    for k in ("copy", "scale", "add", "triad"):
        assert got[f"{k}_gbs"] > 0 and got[f"{k}_nt_gbs"] > 0
    bad = subprocess.run([stream_bench_binary(), "--threads", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--threads takes an integer from 1" in bad.stderr


def test_tiny_cpu_run_records_host_bytes_stream_and_loader_wait(tsd, tmp_path):
    binary = stream_bench_binary()
    results = tmp_path / "finetune.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "finetune_bench.py"), "--device", "cpu", "--arch", "tiny",
           "--batch", "2", "--seq", "16", "--steps", "3", "--modes", "tsd", "--socket", tsd.socket,
           "--results", str(results), "--sample-interval", "0.05", "--stream", "on", "--stream-bin", binary,
           "--stream-mib", "16", "--loader-workers", "2", "--moment-dtype", "float32", "--profile-step", "2"]
    env = dict(os.environ, TSD_BENCH_PROFILE_DIR=str(tmp_path / "profile"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    measured, run, again = benchlib.read_results(str(results))
    assert measured["mode"] == "stream" and measured["status"] == "ok"
    # STREAM again after the modes; the bound divides by the higher figure.
    assert again["mode"] == "stream" and again["status"] == "ok" and again["repeat"] == 1
    assert "the best of 2 measurements in the run" in out.stdout
    assert measured["values"]["bandwidth_gbs"] > 0 and measured["values"]["triad_nt_gbs"] > 0
    assert run["mode"] == "tsd" and run["status"] == "ok", run.get("reason")
    assert run["workload"]["loader_workers"] == 2
    v = run["values"]
    # fp32 weights on a CPU (their slots are their masters), fp32 moments, clipping at 1.0:
    # 28 + 4 + 8 bytes per parameter.
    assert v["host_bytes_per_param"] == 40
    assert v["host_bytes_per_step"] == 40 * run["raw"]["trained_params"]
    assert v["data_wait_ms"] >= 0
    assert len(run["raw"]["data_wait_ms_steps"]) == 2  # the profiled second step's wait is left out, like its time
    assert re.search(r"tsd: 40 B/param, host [0-9.]+ s, GPU [0-9.]+ s, bound [0-9.]+ s, step", out.stdout), out.stdout


def test_loader_workers_must_not_be_negative():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "finetune_bench.py"), "--loader-workers", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--loader-workers must be >= 0" in out.stderr


def test_no_pci_address_off_the_gpu():
    assert gpu_pci_bus_id(torch.device("cpu")) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpus_pci_address_is_sysfs_own():
    bus_id = gpu_pci_bus_id(torch.device("cuda", 0))
    assert re.fullmatch(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.0", bus_id), bus_id
    assert os.path.isdir(f"/sys/bus/pci/devices/{bus_id}"), bus_id


def test_pcie_bench_says_it_needs_a_gpu_or_measures_all_three_ways():
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pcie_bench.py"), "--mib", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--mib and --reps take integers from 1" in bad.stderr
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pcie_bench.py"), "--mib", "64", "--reps", "2"],
                         capture_output=True, text=True, timeout=300)
    if not torch.cuda.is_available():
        assert out.returncode == 1 and "no CUDA device" in out.stderr and "GPU machine" in out.stderr
        return
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["h2d_gbs"] > 0 and got["d2h_gbs"] > 0 and got["both_gbs"] > 0 and got["mib"] == 64
