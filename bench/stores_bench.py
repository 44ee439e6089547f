"""Four LoRA jobs on one base through tsd's weight stores in host RAM (issue 12's "four jobs"
benchmark; docs/stores.md).

    python3 bench/stores_bench.py --tsd-bin build/bin/tsd [--layers 48] [--seq 256] [--results F]
    python3 bench/stores_bench.py --device cpu --tiny     (a smoke run on a machine without a GPU)

It writes a random bf16 checkpoint of the Qwen2.5-14B architecture once (`--layers` fewer for a
quicker run; `--tiny`: a small Qwen2 for the CPU), starts a tsd of its own, and starts four LoRA
jobs (r=16 on every projection, AdamW in tsd, batch 1 x `--seq`) one after another, each loading
the base with `load_model(..., quantize="nf4", store=client)` and training `--steps` steps; then
all four train `--steps` more at once. Each job is a process of bench/gpu_stores_bench.py's
worker: on the GPU it copies the base into its own VRAM ("host" mode: the store is shared in host
RAM, not in VRAM); with `--device cpu` it trains on the CPU from the store's mapping.

Measured:
- tsd's bytes (the pool's used bytes: stores and every job's regions) with one job, and with all
  four: the store is counted once, so four jobs add only their own adapters, optimizer state and
  pages. Pass: `four <= 1.05 x one`. Each job's own bytes in tsd are recorded beside (`jobs_bytes`):
  on the GPU wrap()'s default `offload="auto"` moves a job's adapters' AdamW to the GPU after its
  second step when it fits, and releases the job's memory in tsd; on the CPU it stays in tsd.
- `load_model`'s seconds for each job: the first builds the store (reads and quantizes the
  checkpoint); the later ones map it and read no tensor data. Pass: the second's <= 10% of the first's.
- each trainer's own host memory: its PSS without its mappings of tsd's memory (memfds), at the end.
- every job's losses are equal (the same codes, the same data).

One record per run goes to bench/results/stores.jsonl (bench/benchlib.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
from gpu_stores_bench import QWEN14B, Job, stop_all, write_checkpoint  # noqa: E402

JOBS = 4
# A small Qwen2 for a CPU smoke run (--tiny).
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


def tsd_used(socket: str) -> int:
    import trainstream
    with trainstream.connect(socket=socket) as c:
        return int(c.status().used_bytes)


def tsd_jobs(socket: str) -> dict[str, int]:
    """Each job's bytes in tsd (its regions; a store is charged to the node, not to a job): what
    explains a four-job total above one job's."""
    import trainstream
    with trainstream.connect(socket=socket) as c:
        return {j.name: int(j.used_bytes) for j in c.jobs()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and benchlib.Nvml.open() is None:
        return {"status": "skipped", "reason": "no NVIDIA driver (NVML) here; --device cpu runs on the CPU"}
    arch = dict(TINY) if args.tiny else dict(QWEN14B, num_hidden_layers=args.layers)
    work = args.workdir or tempfile.mkdtemp(prefix="tsd-stores-")
    ckpt = os.path.join(work, "tiny" if args.tiny else f"qwen14b-L{args.layers}")
    t0 = time.time()
    if not os.path.exists(os.path.join(ckpt, "model.safetensors")):
        write_checkpoint(ckpt, **arch)
    print(f"checkpoint ready in {time.time() - t0:.0f} s", flush=True)
    tsd, sock = benchlib.start_tsd(args.tsd_bin, work, args.pool, "--store-keep", "10m")
    mode = "cpu" if args.device == "cpu" else "host"
    jobs: list[Job] = []
    used: list[int] = []
    per_job: list[dict[str, int]] = []  # after each job's steps, then after all four's
    losses: list[list[float]] = []
    try:
        base_used = tsd_used(sock)
        for i in range(JOBS):
            job = Job(sock, ckpt, f"st-{i}", mode, args.seq)
            jobs.append(job)
            losses.append(job.train(args.steps))
            used.append(tsd_used(sock) - base_used)
            per_job.append(tsd_jobs(sock))
            print(f"job {i}: load_model {job.loaded['load_s']:.2f} s, tsd {used[-1] / 2**30:.3f} GiB "
                  f"(jobs' own: {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in per_job[-1].items())})", flush=True)
        for job in jobs:  # all four at once
            job.start_training(args.steps)
        together = [job.losses() for job in jobs]
        used_together = tsd_used(sock) - base_used
        per_job.append(tsd_jobs(sock))
        own = [benchlib.own_pss_bytes(int(job.loaded["pid"])) or 0 for job in jobs]
        for job in jobs:
            job.exit()
    finally:
        stop_all(jobs, tsd)
    load = [float(job.loaded["load_s"]) for job in jobs]
    four = max(used[-1], used_together)
    gib = 2.0 ** 30
    return {"status": "ok",
            "workload": {"arch": "tiny Qwen2" if args.tiny else "Qwen2.5-14B", "layers": arch["num_hidden_layers"],
                         "batch": 1, "seq": args.seq, "quantize": "nf4", "lora_r": 16, "steps": args.steps,
                         "jobs": JOBS, "device": args.device},
            "values": {"tsd_one_job_gib": used[0] / gib, "tsd_four_jobs_gib": four / gib,
                       "tsd_four_over_one": four / used[0], "load_first_s": load[0], "load_second_s": load[1],
                       "load_second_over_first": load[1] / load[0], "load_s": load,
                       "trainer_own_pss_gib": [x / gib for x in own],
                       "pass_tsd": int(four <= 1.05 * used[0]), "pass_load": int(load[1] <= 0.10 * load[0]),
                       "losses_equal": int(all(x == losses[0] for x in losses) and
                                           all(x == together[0] for x in together))},
            "raw": {"used": used, "used_together": used_together, "jobs_bytes": per_job, "losses": losses,
                    "together": together}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tsd-bin", default=os.environ.get("TSD_BIN", os.path.join(HERE, "..", "build", "bin", "tsd")))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small Qwen2 instead of the 14B architecture (CPU smoke)")
    ap.add_argument("--layers", type=int, default=48, help="decoder layers of the 14B architecture (48: all)")
    ap.add_argument("--seq", type=int, default=256,
                    help="tokens per batch (default 256: at 512 four 14B jobs need more than an 80 GB card)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pool", default="90%", help="tsd's --pool-size (default 90%%)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (kept for reruns)")
    ap.add_argument("--results", default=None, help="results file (default bench/results/stores.jsonl)")
    args = ap.parse_args()
    if args.layers < 1 or args.seq < 2 or args.steps < 1:
        ap.error("--layers >= 1, --seq >= 2 and --steps >= 1 are needed")
    out = run(args)
    print(json.dumps(out, indent=1, default=str), flush=True)  # the figures, whatever the recording does
    rec = benchlib.Recorder("stores", results=args.results)
    if out["status"] != "ok":
        rec.record("four_jobs_host_store", {"device": args.device}, {}, status="skipped", reason=out["reason"])
        return 0
    rec.record("four_jobs_host_store", out["workload"], out["values"], extra={"raw": out["raw"]})
    v = out["values"]
    return 0 if v["pass_tsd"] and v["pass_load"] and v["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
