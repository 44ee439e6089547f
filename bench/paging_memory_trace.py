"""Where the device memory of a weight-paged run goes: a diagnostic for the GPU machine.

The CUDA test `test_cuda_paged_equals_unpaged_and_lowers_the_peak` finds torch's peak *higher* with
every block paged than with none (161.6 against 167.8 MiB for a small GPT), while on the CPU the
dropped weights' storages are verifiably freed. This script trains the same model once without
and once with `param_offload=True` on CUDA, records torch's allocator history during the last
step (`torch.cuda.memory._record_memory_history`), and at the end of that step's forward (where
the peak is: every activation saved, backward not started) prints the live allocations of each
run grouped by the Python frame that made them, largest first, and the frames whose bytes differ
between the two runs (`--whole-run`: recorded from the first step, so the peak is the whole run's).
It asserts nothing; its output names what holds the memory.

    TSD_BIN=build/bin/tsd python3 bench/paging_memory_trace.py [--layers 8 --d 256 --batch 8]
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import pickle
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402


def frame_of(block: dict[str, Any]) -> str:
    """The innermost frame of an allocation's stack that is in trainstream, the test model or this
    script (else the innermost Python frame)."""
    frames = block.get("frames") or []
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("trainstream", "gpt.py", "paging_memory_trace")):
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def live_by_frame(snapshot: dict[str, Any]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                out[frame_of(blk)] += blk["size"]
    return out


def live_at_peak(snapshot: dict[str, Any], device: int = 0) -> tuple[int, collections.Counter[str]]:
    """Replays the recorded allocator events of `device` (allocated bytes fall at `free_requested`,
    as torch's own counter does) and returns the highest net growth since recording started and the
    allocations live at that moment, by frame."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if len(traces) > device else []
    live: dict[int, tuple[int, str]] = {}
    now = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for e in events:
        action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if action == "alloc":
            live[addr] = (size, frame_of(e))
            now += size
            if now > best:
                best, best_live = now, dict(live)
        elif action == "free_requested" and addr in live:
            now -= live.pop(addr)[0]
    out: collections.Counter[str] = collections.Counter()
    for size, frame in best_live.values():
        out[frame] += size
    return best, out


def run(socket: str, name: str, param_offload: Any, a: argparse.Namespace
        ) -> tuple[collections.Counter[str], dict[str, float], collections.Counter[str]]:
    import torch
    import trainstream
    from gpt import batches, loss_of, make_gpt

    gc.collect()  # the other run's model may still be alive in a reference cycle: not in this run's figures
    torch.cuda.synchronize()
    model = make_gpt(0, layers=a.layers, d=a.d, seq=a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cuda", socket=socket, offload=True,
                                  param_offload=param_offload, prefetch_depth=1,
                                  **({"param_dtype": torch.bfloat16} if a.bf16_weights else {}))
    data = batches(a.steps, batch=a.batch, seq=a.seq, device="cuda")
    figures: dict[str, float] = {}
    live: collections.Counter[str] = collections.Counter()
    at_peak: collections.Counter[str] = collections.Counter()
    try:
        for i, t in enumerate(data):
            last = i == len(data) - 1
            if i == (0 if a.whole_run else len(data) - 1):  # where recording starts
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                figures["before_step_mib"] = torch.cuda.memory_allocated() / 2**20
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.autocast):
                loss = loss_of(model, t)
            if last:
                torch.cuda.synchronize()
                figures["after_forward_mib"] = torch.cuda.memory_allocated() / 2**20
                live = live_by_frame(torch.cuda.memory._snapshot())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if last:
                torch.cuda.synchronize()
                figures["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                snapshot = torch.cuda.memory._snapshot()
                growth, at_peak = live_at_peak(snapshot)
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    with open(os.path.join(a.dump, f"{name}.pickle"), "wb") as f:
                        pickle.dump(snapshot, f)
                figures["peak_growth_mib"] = growth / 2**20
                torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        trainstream.unwrap(model)
    return live, figures, at_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--autocast", action="store_true", help="run forward under torch.autocast(bfloat16)")
    ap.add_argument("--bf16-weights", action="store_true", help="wrap(param_dtype=torch.bfloat16)")
    ap.add_argument("--whole-run", action="store_true",
                    help="record from the first step on (the peak over every step, not the last one's)")
    ap.add_argument("--dump", metavar="DIR", help="also write each run's allocator snapshot (with its event "
                    "history) to DIR/unpaged.pickle and DIR/paged.pickle, for torch's memory_viz")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("paging_memory_trace: needs CUDA (it reads torch's CUDA allocator)")
    binary = os.environ.get("TSD_BIN", os.path.join(os.path.dirname(HERE), "build", "bin", "tsd"))
    daemon, socket = benchlib.start_tsd(binary, tempfile.mkdtemp(prefix="tsd-trace-"), "4GiB")
    try:
        results = {name: run(socket, name, po, a) for name, po in (("unpaged", False), ("paged", True))}
    finally:
        daemon.terminate()
        daemon.wait()
    for name, (live, fig, peak) in results.items():
        print(f"== {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in fig.items()))
        print("   live at the end of forward (allocated during the step):")
        for frame, nbytes in live.most_common(a.top):
            print(f"   {nbytes / 2**20:8.2f} MiB  {frame}")
        print("   live at the step's peak (allocated during the step):")
        for frame, nbytes in peak.most_common(a.top):
            print(f"   {nbytes / 2**20:8.2f} MiB  {frame}")
    (lu, _, pu), (lp, _, pp) = results["unpaged"], results["paged"]
    for what, u, p in (("the end of forward", lu, lp), ("the peak", pu, pp)):
        print(f"== live at {what}, paged minus unpaged, by frame:")
        diff = {f: p.get(f, 0) - u.get(f, 0) for f in set(u) | set(p)}
        for frame, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.top]:
            if d:
                print(f"   {d / 2**20:+8.2f} MiB  {frame}")


if __name__ == "__main__":
    main()
