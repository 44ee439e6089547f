"""Data parallel on one node: ranks sharing one optimizer in tsd beside ranks that each run their
own CPU optimizer (issue 16's benchmark).

Every mode runs `--ranks` processes on the one GPU (gloo between them: NCCL refuses two ranks on
one device), each training the same Qwen2 architecture (`peers.py`'s ARCH, random weights, seed 0)
on its own random tokens, fp32 weights on the GPU, bf16 autocast, AdamW (lr 1e-5, weight decay
0.01) with fp32 moments, clipping at `--clip`:

  tsd_dp       `trainstream.wrap(..., distributed=True, offload=True)`: the ranks are sessions of one
               tsd job; tsd holds one master and one pair of moments per parameter for the node,
               gradients are reduced before they reach it, every rank copies the update back.
  torchao_dp   torchao's `CPUOffloadOptimizer(AdamW, fused=True)` in every rank (a full fp32 copy
               of the parameters, their gradients and both moments per rank, as TrainStream 0.4
               kept). Its backward hooks copy each gradient to the host as it is made, before any
               reduction could run, so the ranks average those host gradients over gloo before
               `step()` (DDP's allreduce would come after the copies and be lost), then clip them
               by their global norm: the correct data-parallel use of it.

The figure of interest is the node's host memory: the peak of the ranks' PSS plus tsd's (shared
memory counted once), sampled from outside every 0.5 s; step time is the median of rank 0's steps
after the first two. Records go through bench/benchlib.py (`--results`).

    python3 bench/dp_bench.py --peers .devdeps --tsd-bin build/bin/tsd [--arch qwen0.5b --batch 8 --seq 512 --ranks 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402

MODES = ("tsd_dp", "torchao_dp")
LR, WEIGHT_DECAY = 1e-5, 0.01


def load_peers(folder: str) -> Any:
    path = folder if folder.endswith(".py") else os.path.join(folder, "peers.py")
    spec = importlib.util.spec_from_file_location("peers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def average_host_grads(host_params: list[Any], world: int) -> None:
    """All-reduces the host gradients over gloo, flattened into buckets of about 64 MiB."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in host_params if p.grad is not None]
    bucket: list[Any] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        at = 0
        for g in bucket:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= 64 << 20:
            flush()
    flush()


def rank_main(rank: int, a: argparse.Namespace, port: int, socket: Optional[str], out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    peers = load_peers(a.peers)
    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=4096, attn_implementation="sdpa", **peers.ARCH[a.arch])
    cuda = a.device == "cuda"
    model = Qwen2ForCausalLM(cfg).to(a.device)
    nparams = sum(p.numel() for p in model.parameters())
    t0 = time.time()
    if a.mode == "tsd_dp":
        import trainstream
        opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        model, opt = trainstream.wrap(model, opt, device=a.device, socket=socket, distributed=True, offload=True,
                                      moment_dtype="float32", max_grad_norm=a.clip or None)

        def step(ids: Any) -> Any:
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        from torchao.optim import CPUOffloadOptimizer
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        host = list(opt.param_d2h_map.values())

        def step(ids: Any) -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()  # the hooks' gradient copies to the host are done
            average_host_grads(host, a.ranks)
            if a.clip:
                torch.nn.utils.clip_grad_norm_(host, a.clip)
            opt.step()
            opt.zero_grad()
            return loss
    setup_s = time.time() - t0
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(a.steps):
        dist.barrier()
        sync()
        t = time.perf_counter()
        loss = step(ids)
        sync()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    dist.barrier()
    if rank == 0:
        settled = sorted(times[2:]) or sorted(times)
        with open(out_path, "w") as f:
            json.dump(dict(mode=a.mode, params=nparams, step_s_median=settled[len(settled) // 2], steps=times,
                           losses=losses, peak_vram_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                           setup_s=setup_s), f)
    if a.mode == "tsd_dp":
        import trainstream
        trainstream.unwrap(model)
    dist.destroy_process_group()


def launch(a: argparse.Namespace) -> None:
    """The measured process: spawns the ranks, waits for them, prints rank 0's figures."""
    import torch.multiprocessing as mp
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python"))
    from ranks import free_port

    out_path = os.path.join(tempfile.mkdtemp(prefix="dp-bench-"), "rank0.json")
    mp.spawn(rank_main, args=(a, free_port(), a.socket, out_path), nprocs=a.ranks, join=True)
    with open(out_path) as f:
        print("@@" + f.read(), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen0.5b", help="an architecture of peers.py")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: tsd_dp only, a smoke run of the script (torchao's optimizer needs CUDA)")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (0 turns clipping off)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all modes, interleaved")
    ap.add_argument("--peers", default=".devdeps", help="the folder of peers.py (or peers.py itself)")
    ap.add_argument("--tsd-bin", default=os.environ.get("TSD_BIN", os.path.join(os.path.dirname(HERE), "build", "bin", "tsd")))
    ap.add_argument("--pool-size", default="96GiB")
    ap.add_argument("--results", default=None, help="results file (default bench/results/dp.jsonl)")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)    # internal: the launched process
    ap.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES or (a.device == "cpu" and m != "tsd_dp")]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)} for --device {a.device}; choose from "
                 f"{', '.join(MODES if a.device == 'cuda' else MODES[:1])}")
    if a.mode:
        launch(a)
        return 0
    rec = benchlib.Recorder("dp", a.results)
    nvml = benchlib.Nvml.open()
    workload = dict(device=a.device, arch=a.arch, batch=a.batch, seq=a.seq, ranks=a.ranks, clip=a.clip, steps=a.steps,
                    weights="fp32", autocast="bf16", moments="fp32")
    failed = 0
    for repeat in range(a.repeats):
        for mode in modes:
            daemon, socket = None, None
            if mode == "tsd_dp":
                daemon, socket = benchlib.start_tsd(a.tsd_bin, tempfile.mkdtemp(prefix="tsd-dp-"), a.pool_size)
            argv_child = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--arch", a.arch,
                          "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--ranks", str(a.ranks),
                          "--clip", str(a.clip), "--peers", a.peers, "--modes", mode, "--device", a.device]
            if socket:
                argv_child += ["--socket", socket]
            tsd_used, client = None, None
            if socket:
                import trainstream
                client = trainstream.connect(socket=socket)
                tsd_used = lambda: sum(j.used_bytes for j in client.jobs())  # noqa: E731
            run = benchlib.run_sampled(argv_child, daemon_pid=daemon.pid if daemon else None, tsd_used=None,
                                       nvml=nvml)
            if client is not None:
                client.close()
            if daemon is not None:
                daemon.terminate()
                daemon.wait()
            line = next((ln[2:] for ln in run.stdout.splitlines() if ln.startswith("@@")), None)
            if run.returncode != 0 or line is None:
                failed += 1
                tail = (run.stderr or run.stdout).strip().splitlines()[-15:]
                print(f"{mode}: failed ({run.returncode})\n" + "\n".join(tail), flush=True)
                rec.record(mode, workload, run.values(), status="failed", reason=" | ".join(tail[-3:])[:2000],
                           repeat=repeat)
                continue
            raw = json.loads(line)
            values = dict(run.values(), step_s=raw["step_s_median"], peak_vram_gib=raw["peak_vram_gib"],
                          first_loss=raw["losses"][0], last_loss=raw["losses"][-1], setup_s=raw["setup_s"],
                          params=raw["params"])
            rec.record(mode, workload, values, repeat=repeat, extra={"raw": raw})
            print(f"{mode}: {raw['step_s_median']:.3f} s/step, host PSS peak "
                  f"{values.get('host_pss_peak_gib', float('nan')):.1f} GiB (trainers "
                  f"{values.get('trainer_pss_peak_gib', float('nan')):.1f}, tsd {values.get('tsd_pss_peak_gib', 0):.1f}), "
                  f"peak VRAM/rank {raw['peak_vram_gib']:.1f} GiB, losses {raw['losses'][0]:.4f} -> "
                  f"{raw['losses'][-1]:.4f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
