"""Device copies of weight stores (tsd's `gpu_stores`; docs/stores.md, "Device copies").

Without a GPU (CI): a tsd with gpu_stores on starts and serves host stores as before, and asking
for a device copy fails with a clear error. With a GPU (skipped otherwise): two processes on one
GPU map one device copy and train LoRA on it with losses equal to a run whose base is a private
copy from the host store; killing one leaves the copy (and its user count) right for the other;
whole-device VRAM (NVML) shows the base held once. The workers are bench/gpu_stores_bench.py's.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import trainstream
from conftest import Daemon

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
safetensors_torch = pytest.importorskip("safetensors.torch")


def _gpu_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        trainstream._C.gpu_uuid(0)
    except trainstream.TsdError:
        return False
    return True


@pytest.fixture
def gpu_tsd(tmp_path):
    d = Daemon(tmp_path, pool="8GiB", args=("--gpu-stores", "--store-keep", "10m"))
    yield d
    d.stop()


def test_without_a_usable_gpu_a_device_copy_is_refused_and_the_host_store_works(gpu_tsd, tmp_path):
    if _gpu_usable():
        pytest.skip("this machine has a usable GPU: the GPU tests below cover it")
    path = str(tmp_path / "w.safetensors")
    w = torch.randn(64, 128)
    safetensors_torch.save_file({"w": w}, path)
    with trainstream.connect(socket=gpu_tsd.socket, job="nogpu") as c:
        st = c.open_store([path], "nf4", 64, [("w", True)])
        with pytest.raises(trainstream.TsdError, match="CUDA driver|GPU|cuda"):
            st.to_device(0)
        assert st.quantized("w")[0].numel() == 64 * 128 // 2  # the host store still serves
        [info] = [s for s in c.stores() if s.id == st.id]
        assert info.device_copies == () and info.users == 1
    assert "gpu_stores_on" in gpu_tsd.log()


def test_a_store_that_is_not_open_has_no_device_copy(gpu_tsd, tmp_path):
    path = str(tmp_path / "w.safetensors")
    safetensors_torch.save_file({"w": torch.randn(64, 64)}, path)
    with trainstream.connect(socket=gpu_tsd.socket, job="closed") as c:
        st = c.open_store([path], "nf4", 64, [("w", True)])
        st.close()
        with pytest.raises(ValueError, match="was closed"):
            st.to_device(0)


gpu = pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU and driver")


def _device_used() -> int:
    import gpu_stores_bench as gsb
    import benchlib
    nvml = benchlib.Nvml.open()
    if nvml is None:
        pytest.skip("NVML (libnvidia-ml) is not available to measure whole-device memory")
    return gsb.device_used(nvml, settle_s=2.0)


@gpu
def test_two_processes_share_one_device_copy_and_train_like_a_private_base(gpu_tsd, tmp_path):
    import gpu_stores_bench as gsb

    ckpt = str(tmp_path / "ckpt")
    # About 0.4 GiB of NF4 base: far above the noise of CUDA contexts and allocator caches.
    base = gsb.write_checkpoint(ckpt, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=2048)
    sock = gpu_tsd.socket
    jobs: list = []
    try:
        u0 = _device_used()
        a = gsb.Job(sock, ckpt, "gpu-a", "device", 128)
        jobs.append(a)
        la = a.train(3)
        u1 = _device_used()
        b = gsb.Job(sock, ckpt, "gpu-b", "device", 128)
        jobs.append(b)
        lb = b.train(3)
        u2 = _device_used()
        store = int(a.loaded["store"])
        assert int(b.loaded["store"]) == store
        copies = gsb.copies_of(sock, store)
        assert len(copies) == 1, copies  # one copy on the GPU for both jobs
        assert copies[0].users == 2 and copies[0].bytes >= base
        assert copies[0].gpu_uuid == a.loaded["gpu_uuid"] == b.loaded["gpu_uuid"]
        if not a.loaded["read_only"]:
            print(f"device copy mapped read-write: {a.loaded['access_note']}")

        # A killed job leaves the copy to the other, which keeps training on it.
        a.kill()
        deadline = time.time() + 30
        while gsb.copies_of(sock, store)[0].users != 1:
            assert time.time() < deadline, "tsd did not release the killed job's use of the device copy"
            time.sleep(0.2)
        lb2 = b.train(3)
        b.exit()
        [after] = gsb.copies_of(sock, store)
        assert after.users == 0 and after.bytes == copies[0].bytes  # kept warm for store_keep

        # The reference: the same base as a private copy in the job's own VRAM.
        u3 = _device_used()
        c = gsb.Job(sock, ckpt, "gpu-c", "host", 128)
        jobs.append(c)
        lc = c.train(6)
        u4 = _device_used()
        c.exit()
    finally:
        for j in jobs:
            j.kill()
    assert la == lb == lc[:3], (la, lb, lc)
    assert lb + lb2 == lc, (lb + lb2, lc)
    one_job, both, host_job = u1 - u0, u2 - u0, u4 - u3
    own = host_job - base  # a job's VRAM without the base
    print(f"base {base / 2**20:.0f} MiB; one job (with tsd's copy) {one_job / 2**20:.0f} MiB; both "
          f"{both / 2**20:.0f} MiB; the second added {(u2 - u1) / 2**20:.0f} MiB; a job with a private base "
          f"{host_job / 2**20:.0f} MiB")
    # The base is held once: the second job adds only its own memory, not another base.
    assert u2 - u1 <= host_job - 0.8 * base
    assert both <= one_job + own + 0.05 * one_job
