"""Data parallel through tsd with one rank per GPU and NCCL (issue 17's correctness check): the
ranks of a group initialized as "cpu:gloo,cuda:nccl", rank r on cuda:r, share one tsd job's
optimizer and train as torch DDP (over NCCL) + torch.optim.AdamW does: within 1e-6 after 20 fp32
steps, with accumulation and clipping that bites (tests/python/dist_worker.py's `parity`).

At 2 ranks and at every larger power of two up to the machine's GPU count (skipped with fewer
than 2 GPUs), and a group of one rank on one GPU, which takes the same NCCL path (skipped without
CUDA; `pytest --cuda-tests` selects these on the GPU machine)."""
from __future__ import annotations

import json
import os
from typing import Optional

import pytest
import torch

import dist_worker
from ranks import free_port, spawn_ranks
from test_distributed import _check_parity, _daemon

BACKEND = "cpu:gloo,cuda:nccl"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8, 16) if w <= max(GPUS, 2)]

needs_gpus = pytest.mark.skipif(
    GPUS < 2 or not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
    reason=f"needs CUDA with at least 2 GPUs and torch.distributed with NCCL (this machine has {GPUS} GPUs)")


def _run(world: int, sockets: list[str], out_dir: str, timeout: float = 300) -> list[Optional[dict]]:
    """Starts `world` ranks of dist_worker's parity mode, one per GPU, waits for them (killing
    any left after `timeout`) and returns their results by rank (None: a rank wrote none)."""
    port = free_port()
    spawn_ranks(dist_worker.main, lambda r: (r, world, port, sockets, "parity", out_dir, "cuda", BACKEND), world,
                timeout)
    out = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        out.append(json.load(open(path)) if os.path.exists(path) else None)
    return out


def test_clipping_bites_in_the_parity_workload():
    """(Runs on the CPU.) The comparison covers clipping only if it scales the gradients: the first
    step's global norm of the workload, the gradients averaged over 2 ranks' data as DDP averages
    them, is well above MAX_NORM."""
    model = dist_worker._model()
    for rank in range(2):
        for x, y in dist_worker._batches(rank, 1)[0]:
            (dist_worker._loss(model, x, y) / 2).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    assert norm > 2 * dist_worker.MAX_NORM, f"norm {norm:.4f} would not be clipped at {dist_worker.MAX_NORM}"


@needs_gpus
@pytest.mark.parametrize("world", WORLDS)
def test_one_rank_per_gpu_nccl_matches_ddp_adamw_one_tsd(tmp_path, world):
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(world, [d.socket] * world, str(out))
        _check_parity(results, world, nodes=1, out_dir=str(out))
        assert [res["cuda_device"] for res in results] == list(range(world)), "a rank ran on another rank's GPU"
        assert d.log().count("event=optimizer_registered") == 1  # one optimizer for the node's ranks
    finally:
        d.stop()


@pytest.mark.skipif(GPUS < 1 or not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs CUDA and torch.distributed with NCCL")
def test_one_rank_nccl_group_on_one_gpu_matches_ddp_adamw(tmp_path):
    """A group of one rank with NCCL (distributed=True) takes the path of several: each bucket's
    gradient reduced by NCCL during backward, the owner's copy into tsd and its doorbell queued on
    the side stream behind it. On a machine with one GPU this is how that path runs at all."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(1, [d.socket], str(out))
        _check_parity(results, 1, nodes=1, out_dir=str(out))
        assert "gradients reduced on cuda through nccl, bucket by bucket" in results[0]["events"], results[0]["events"]
    finally:
        d.stop()
