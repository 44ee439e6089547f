"""Issue 10's save and restore of a wrapped model, as `bench/finetune_bench.py --save-restore`
runs it after its timed steps: streaming saves of the model's tensors and tsd's optimizer state,
steps trained twice from the saved point, and the trainer's anonymous memory across both."""
from __future__ import annotations

import os
import sys
import time
from typing import Any


def _rss_anon() -> int:
    """This process's anonymous resident memory (RssAnon), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def fixed_batches(vocab: int, batch: int, seq: int, device: str, n: int = 2) -> list[Any]:
    """`n` random token batches from a fixed seed, on `device`."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def check(model: Any, opt: Any, batches: list[Any], autocast: bool) -> dict[str, Any]:
    """Issue 10's save and restore on a wrapped model: the model's tensors (state_dict(), paged
    blocks' values from tsd memory) are written one tensor at a time into a file, and the optimizer's
    state by tsd itself (`save_state` into a descriptor the trainer opened); a step trains on each of
    `batches`; then both are restored (`load_state_dict` one tensor at a time, `load_state`) and
    the same steps train again. `resume_exact` is 1 when both runs of losses are bit-identical.
    The trainer's anonymous memory (RssAnon) growth across save and across restore is recorded: the
    bound is one tensor, not the model."""
    import tempfile

    import torch

    folder = tempfile.mkdtemp(prefix="tsd-save-", dir=os.environ.get("TSD_BENCH_SAVE_DIR"))
    weights, state = os.path.join(folder, "model.bin"), os.path.join(folder, "optimizer.safetensors")

    def two_steps() -> list[float]:
        losses = []
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    index: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []  # name, dtype, shape, bytes
    rss0, t = _rss_anon(), time.time()
    with open(weights, "wb") as f:
        for k, v in model.state_dict(keep_vars=False).items():
            host = v.detach().to("cpu").contiguous()
            raw = host.reshape(-1).view(torch.uint8)
            f.write(raw.numpy())  # the tensor's own bytes, no second copy
            index.append((k, host.dtype, tuple(host.shape), raw.numel()))
            del host, raw
    with open(state, "wb") as f:
        written = opt.save_state(f)
    out: dict[str, Any] = {"save_s": time.time() - t, "save_rss_anon_growth_mib": (_rss_anon() - rss0) / 2**20,
                           "saved_gib": (os.path.getsize(weights) + written) / 2**30}
    first = two_steps()
    rss0, t = _rss_anon(), time.time()
    with open(weights, "rb") as f:
        for k, dtype, shape, n in index:
            raw = torch.empty(n, dtype=torch.uint8)
            if f.readinto(raw.numpy()) != n:
                raise EOFError(f"{weights} ends inside {k}")
            model.load_state_dict({k: raw.view(dtype).reshape(shape)}, strict=False)
            del raw
    with open(state, "rb") as f:
        opt.load_state(f)
    out.update(restore_s=time.time() - t, restore_rss_anon_growth_mib=(_rss_anon() - rss0) / 2**20)
    second = two_steps()
    out.update(resume_exact=int(first == second), resume_losses=[first, second])
    print(f"save and restore: {out}", file=sys.stderr, flush=True)
    for path in (weights, state):
        os.unlink(path)
    os.rmdir(folder)
    return out
