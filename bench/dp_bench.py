"""Data parallel on one node: ranks sharing one optimizer in tsd beside the peers' ways of training
data parallel with the optimizer on the CPU, and FSDP2 in VRAM (issues 16 and 17).

Every mode trains the same Qwen2 architecture (`peers.py`'s ARCH, random weights, seed 0), each
rank on its own random tokens (`--batch` x `--seq` per rank), bf16 compute, AdamW (lr 1e-5,
weight decay 0.01) with fp32 moments, clipping at `--clip`. The modes (bench/dp_modes.py says
each): tsd_dp, torchao_dp, ds_offload_dp, fsdp2_offload_dp, fsdp2_dp.

Where the ranks run:
  (default)    `--ranks` processes on the one GPU, gloo between them (NCCL refuses two ranks on
               one device): issue 16's setting; tsd_dp and torchao_dp only.
  --gpus N     one rank per GPU (rank r on cuda:r), the process group "cpu:gloo,cuda:nccl".
  --scaling 1,2,4,8   the modes at each GPU count in turn, one rank per GPU; counts above the
               machine's GPUs are skipped with a note (and a skipped record).
  --device cpu `--ranks` processes on the CPU over gloo (tsd_dp and fsdp2_dp): a smoke run.

Figures per run (one record per mode and GPU count, through bench/benchlib.py into `--results`):
rank 0's median step time after the first two steps (`step_s`), tokens per second (batch x seq
x ranks / step), rank 0's breakdown as finetune_bench's (`gpu_forward_ms`, `gpu_backward_ms`: GPU
time between CUDA events, wall time on the CPU; `step_wait_ms`: the wall time from backward's
return to the step's end, the optimizer with what it waits for), every rank's torch peak (`vram_torch_peak_gib_per_rank`), the whole-device
peak of every GPU used (NVML, less what it held before the run; `vram_device_peak_gib` is the
largest), and the node's host memory: the peak of the ranks' PSS plus tsd's (shared memory
counted once), sampled from outside every `--sample-interval` s. The `*_steps_peak_gib` figures
are the same peaks over the timed steps only, without setup's transients (the model is built on
the CPU in every rank, then placed as its mode places it).

    python3 bench/dp_bench.py --peers .devdeps --tsd-bin build/bin/tsd [--arch qwen0.5b --batch 8 --seq 512 --ranks 2]
    python3 bench/dp_bench.py --peers .devdeps --gpus 2 --arch qwen7b --batch 4 --seq 512 \\
        --modes tsd_dp,ds_offload_dp,fsdp2_offload_dp,fsdp2_dp
    python3 bench/dp_bench.py --peers .devdeps --scaling 1,2,4,8 --arch qwen7b --batch 4 --seq 512 --modes tsd_dp
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import dp_modes  # noqa: E402

MODES = dp_modes.MODES
NCCL_BACKEND = "cpu:gloo,cuda:nccl"
STRAGGLER_S = 60.0  # how long the launcher waits for the other ranks once one has failed


def load_peers(folder: str) -> Any:
    """peers.py of `folder` (or the file itself), for its ARCH table."""
    path = folder if folder.endswith(".py") else os.path.join(folder, "peers.py")
    if not os.path.exists(path):
        raise SystemExit(f"dp_bench: no peers.py at {path}: pass --peers (the folder holding shared/bench/peers.py)")
    spec = importlib.util.spec_from_file_location("peers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_model(a: argparse.Namespace) -> Any:
    """The workload's model in host memory: `peers.ARCH[a.arch]` as a Qwen2 causal LM, fp32, random
    weights (normal(0, 0.02), as transformers initialises them) from seed 0, the same on every rank
    and in every mode; gradient checkpointing with --grad-ckpt. On a GPU machine each tensor is
    drawn on the rank's GPU and copied over (bench/finetune_model.py's drawn_model: torch draws on
    the CPU in one thread, about a minute for a 7B model), one at a time."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    peers = load_peers(a.peers)
    if a.arch not in peers.ARCH:
        raise SystemExit(f"dp_bench: --arch {a.arch} is not in {a.peers}'s ARCH ({', '.join(peers.ARCH)})")
    torch.manual_seed(0)
    cfg = Qwen2Config(max_position_embeddings=4096, attn_implementation="sdpa", **peers.ARCH[a.arch])  # type: ignore[call-arg]
    if a.device == "cuda":
        from finetune_model import drawn_model
        model = drawn_model(cfg, torch.float32, "cpu", "cuda")
    else:
        model = Qwen2ForCausalLM(cfg)
    if a.grad_ckpt:
        model.gradient_checkpointing_enable()
    return model


def placement(a: argparse.Namespace) -> str:
    """"cpu", "one_gpu" (every rank on the one GPU, gloo) or "per_gpu" (one rank per GPU, NCCL)."""
    if a.device == "cpu":
        return "cpu"
    return "per_gpu" if a.gpus else "one_gpu"


def world_of(a: argparse.Namespace) -> int:
    """The ranks of a run: one per GPU with --gpus, else --ranks."""
    return int(a.gpus) if a.gpus else int(a.ranks)


def rank_main(rank: int, a: argparse.Namespace, port: int, socket: Optional[str], out_dir: str) -> None:
    """One rank: joins the group, sets its mode up, times `a.steps` steps on its own tokens and
    writes its figures to `out_dir`/rank<R>.json (rank 0 also marks the timed steps with
    `a.phase_file`, for the sampler)."""
    import torch
    import torch.distributed as dist

    world = world_of(a)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    per_gpu = placement(a) == "per_gpu"
    if per_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(NCCL_BACKEND if per_gpu else "gloo", rank=rank, world_size=world)
    cuda = a.device == "cuda"
    if not cuda:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    model = build_model(a)
    nparams = sum(p.numel() for p in model.parameters())
    t0 = time.time()
    step, handle = dp_modes.setup(a.mode, model, a, rank, world, a.device, socket)
    setup_s = time.time() - t0
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()  # setup's cached blocks are not the steps' memory
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    marks = dp_modes.Marks(cuda)
    dist.barrier()
    if rank == 0 and a.phase_file:
        open(a.phase_file, "w").close()
    for _ in range(a.steps):
        dist.barrier()
        sync()
        t = time.perf_counter()
        marks.start()
        loss = step(ids, marks)
        sync()
        times.append(time.perf_counter() - t)
        marks.end()
        losses.append(float(loss.detach()))
    dist.barrier()
    if rank == 0 and a.phase_file and os.path.exists(a.phase_file):
        os.unlink(a.phase_file)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        med = benchlib.settled_median
        json.dump(dict(rank=rank, params=nparams, step_s_median=med(times), steps=times,
                       gpu_forward_ms=med(marks.fwd_ms), gpu_backward_ms=med(marks.bwd_ms),
                       step_rest_ms=med(marks.rest_ms),
                       losses=losses, setup_s=setup_s,
                       torch_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                       events=dp_modes.events(a.mode, handle)), f)
    dp_modes.teardown(a.mode, handle)
    dist.barrier()
    dist.destroy_process_group()


def launch(a: argparse.Namespace) -> None:
    """The measured process: spawns the ranks, waits for them (once one fails, the others get
    STRAGGLER_S seconds before they are killed) and prints their figures as one @@{json} line."""
    world = world_of(a)
    out_dir = tempfile.mkdtemp(prefix="dp-bench-")
    ctx = multiprocessing.get_context("spawn")
    sys.path.insert(0, os.path.join(benchlib.ROOT, "tests", "python"))
    from ranks import free_port  # the tests' helper: a loopback port nothing listens on

    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a, port, a.socket, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    failed_at: Optional[float] = None
    while any(p.is_alive() for p in procs):
        time.sleep(0.2)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > STRAGGLER_S:
            for p in procs:
                if p.is_alive():
                    p.kill()
    for p in procs:
        p.join()
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise SystemExit(f"dp_bench: {a.mode}: rank(s) {', '.join(map(str, bad))} exited with "
                         f"{', '.join(str(c) for c in bad.values())} (the first rank's error is above)")
    ranks = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    first = ranks[0]
    print("@@" + json.dumps(dict(mode=a.mode, world=world, params=first["params"], step_s_median=first["step_s_median"],
                                 steps=first["steps"], losses=first["losses"], setup_s=first["setup_s"],
                                 peak_vram_gib=first["torch_peak_gib"] or 0.0,
                                 torch_peak_gib_per_rank=[r["torch_peak_gib"] for r in ranks],
                                 step_s_median_per_rank=[r["step_s_median"] for r in ranks],
                                 last_loss_per_rank=[r["losses"][-1] for r in ranks],
                                 gpu_forward_ms=first["gpu_forward_ms"], gpu_backward_ms=first["gpu_backward_ms"],
                                 step_rest_ms=first["step_rest_ms"],
                                 events=first.get("events", []))), flush=True)


def parse_counts(text: str) -> list[int]:
    """`--scaling 1,2,4,8` as GPU counts (each >= 1, no repeats, in the order given)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scaling {text!r}: give GPU counts, e.g. 1,2,4,8") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"--scaling {text!r}: give distinct GPU counts >= 1, e.g. 1,2,4,8")
    return counts


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, checked (what needs the machine, such as its GPU count, is checked in main)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--arch", default="qwen0.5b", help="an architecture of peers.py")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=None, help="ranks on the one GPU or the CPU (default 2); "
                    "with --gpus or --scaling there is one rank per GPU")
    ap.add_argument("--gpus", type=int, default=None, help="one rank per GPU on this many GPUs (NCCL)")
    ap.add_argument("--scaling", type=parse_counts, default=None, metavar="1,2,4,8",
                    help="run the modes at each GPU count, one rank per GPU (counts above the machine's are skipped)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help=f"cpu: a smoke run of the script ({', '.join(dp_modes.CPU_MODES)})")
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm (0 turns clipping off)")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16"],
                    help="tsd_dp's weights on the GPU (bf16: working copies, fp32 masters in tsd)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in every mode")
    ap.add_argument("--overlap", action="store_true",
                    help="tsd_dp: overlap_forward=True (tsd's updates finish during the next forward)")
    ap.add_argument("--gpu-fraction", type=float, default=0.0, metavar="F",
                    help="tsd_dp: optimizer_gpu_fraction=F (every rank updates that share of the parameters on its "
                         "GPU; 0 keeps every update in tsd)")
    ap.add_argument("--modes", default="tsd_dp,torchao_dp")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all modes, interleaved")
    ap.add_argument("--peers", default=".devdeps", help="the folder of peers.py (or peers.py itself)")
    ap.add_argument("--tsd-bin", default=os.environ.get("TSD_BIN", os.path.join(os.path.dirname(HERE), "build", "bin", "tsd")))
    ap.add_argument("--pool-size", default="96GiB", help="tsd's pool (the 7B architecture needs about 16 bytes a "
                    "parameter: --pool-size 150GiB or a share of RAM, 70%%)")
    ap.add_argument("--sample-interval", type=float, default=0.5, help="seconds between memory samples (default 0.5)")
    ap.add_argument("--results", default=None, help="results file (default bench/results/dp.jsonl)")
    ap.add_argument("--run-id", default=None, help="continue run RUN_ID (of the results file or bench/results/dp.jsonl) "
                    "instead of starting a run: one figure's modes measured by several commands")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)    # internal: the launched process
    ap.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase-file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.modes_list = [m for m in a.modes.split(",") if m]
    unknown = [m for m in a.modes_list if m not in MODES]
    if unknown or not a.modes_list:
        ap.error(f"unknown mode(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}")
    if a.gpus is not None and a.scaling is not None:
        ap.error("give --gpus N (one run) or --scaling 1,2,... (a run at each count), not both")
    if a.gpus is not None and a.gpus < 1:
        ap.error("--gpus must be >= 1")
    if (a.gpus is not None or a.scaling is not None) and a.device != "cuda":
        ap.error("--gpus and --scaling place one rank on each GPU: they need --device cuda")
    if a.ranks is not None and (a.gpus is not None or a.scaling is not None) and a.ranks != (a.gpus or a.ranks):
        ap.error(f"--ranks {a.ranks} with --gpus {a.gpus}: there is one rank per GPU (leave --ranks out)")
    if a.ranks is not None and a.scaling is not None:
        ap.error("--scaling sets the ranks (one per GPU at each count): leave --ranks out")
    if a.ranks is None:
        a.ranks = a.gpus or 2
    if a.ranks < 1 or a.batch < 1 or a.seq < 2 or a.steps < 1 or a.repeats < 1:
        ap.error("--ranks, --batch, --steps and --repeats must be >= 1 and --seq >= 2")
    if a.clip < 0 or a.sample_interval <= 0:
        ap.error("--clip must be >= 0 and --sample-interval > 0")
    return a


def visible_gpus() -> int:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES honoured), without a CUDA context."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def configurations(a: argparse.Namespace, available: int) -> tuple[list[Optional[int]], dict[int, str]]:
    """The GPU counts to run (None: the ranks share one GPU, or the CPU) and, for --scaling counts the
    machine does not have, why each is skipped. Exits with a message where the run cannot start here."""
    if a.device == "cpu":
        return [None], {}
    if available == 0:
        raise SystemExit("dp_bench: no CUDA device is visible: run on a GPU machine, or --device cpu for a smoke run")
    if a.gpus is not None:
        if a.gpus > available:
            raise SystemExit(f"dp_bench: --gpus {a.gpus}: this machine has {available} visible CUDA "
                             f"device{'s' if available != 1 else ''}")
        return [a.gpus], {}
    if a.scaling is None:
        return [None], {}
    skipped = {n: f"the machine has {available} GPU{'s' if available != 1 else ''}" for n in a.scaling if n > available}
    for n, why in skipped.items():
        print(f"dp_bench: skipping {n} GPUs: {why}", flush=True)
    return list(a.scaling), skipped


def child_argv(a: argparse.Namespace, mode: str, gpus: Optional[int], socket: Optional[str],
               phase_file: Optional[str]) -> list[str]:
    """The launched process's command line: this script with `--mode` and the run's settings."""
    argv = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--modes", mode, "--arch", a.arch,
            "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--clip", str(a.clip),
            "--weights", a.weights, "--peers", a.peers, "--device", a.device]
    argv += ["--gpus", str(gpus)] if gpus else ["--ranks", str(a.ranks)]
    if a.grad_ckpt:
        argv.append("--grad-ckpt")
    if a.overlap:
        argv.append("--overlap")
    if a.gpu_fraction:
        argv += ["--gpu-fraction", str(a.gpu_fraction)]
    if socket:
        argv += ["--socket", socket]
    if phase_file:
        argv += ["--phase-file", phase_file]
    return argv


def workload(a: argparse.Namespace, mode: str, gpus: Optional[int]) -> dict[str, Any]:
    """What a record of `mode` at `gpus` GPUs ran (None: --ranks on one GPU or the CPU)."""
    where = "cpu" if a.device == "cpu" else ("per_gpu" if gpus else "one_gpu")
    ranks = gpus or a.ranks
    out = dict(device=a.device, arch=a.arch, batch=a.batch, seq=a.seq, ranks=ranks,
               gpus=0 if where == "cpu" else (gpus or 1), placement=where,
               backend=NCCL_BACKEND if where == "per_gpu" else "gloo", clip=a.clip, steps=a.steps,
               weights=a.weights if mode == "tsd_dp" else None, autocast="bf16", moments="fp32",
               grad_ckpt=a.grad_ckpt, precision=dp_modes.precision(mode, a.weights))
    if mode == "tsd_dp":  # tsd's own options, named only where set (older records lack them)
        if a.overlap:
            out["overlap"] = True
        if a.gpu_fraction:
            out["gpu_fraction"] = a.gpu_fraction
    return out


def values_of(run: benchlib.ChildRun, raw: dict[str, Any], a: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """A measured run's record values: the sampler's peaks and the ranks' own figures."""
    step = raw["step_s_median"]
    torch_peaks = [p for p in raw.get("torch_peak_gib_per_rank", []) if p is not None]
    v: dict[str, Any] = dict(run.values(), step_s=step, step_s_median=step, step_s_all=raw["steps"],
                             tokens_per_s=a.batch * a.seq * ranks / step if step > 0 else None,
                             peak_vram_gib=raw["peak_vram_gib"], first_loss=raw["losses"][0],
                             last_loss=raw["losses"][-1], setup_s=raw["setup_s"], params=raw["params"],
                             step_s_median_per_rank=raw["step_s_median_per_rank"],
                             gpu_forward_ms=raw["gpu_forward_ms"], gpu_backward_ms=raw["gpu_backward_ms"],
                             step_wait_ms=raw["step_rest_ms"])
    if torch_peaks:
        v.update(vram_torch_peak_gib=max(torch_peaks), vram_torch_peak_gib_per_rank=torch_peaks)
    return v


def run_one(a: argparse.Namespace, rec: benchlib.Recorder, nvml: Optional[benchlib.Nvml], mode: str,
            gpus: Optional[int], repeat: int) -> bool:
    """Runs and records one mode at one GPU count; False if it failed."""
    wl = workload(a, mode, gpus)
    why = dp_modes.skip_reason(mode, a.device, gpus)
    if why is not None:
        print(f"{mode}: skipped: {why}", flush=True)
        rec.record(mode, wl, {}, status="skipped", reason=why, repeat=repeat)
        return True
    scratch = tempfile.mkdtemp(prefix="dp-bench-")
    daemon, socket = None, None
    if mode == "tsd_dp":
        daemon, socket = benchlib.start_tsd(a.tsd_bin, scratch, a.pool_size)
    phase_file = os.path.join(scratch, "steps")
    indices: Optional[list[int]] = None
    if nvml is not None:
        indices = benchlib.Nvml.indices_for_visible(gpus) if gpus else [benchlib.Nvml.index_for_visible()]
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")  # cuda:r is NVML's device r (or CUDA_VISIBLE_DEVICES' r-th)
    try:
        run = benchlib.run_sampled(child_argv(a, mode, gpus, socket, phase_file), a.sample_interval,
                                   daemon_pid=daemon.pid if daemon else None, nvml=nvml, gpu_indices=indices,
                                   env=env, phase_file=phase_file)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
    line = next((ln[2:] for ln in run.stdout.splitlines() if ln.startswith("@@")), None)
    where = f" at {gpus} GPU{'s' if gpus != 1 else ''}" if gpus else ""
    if run.returncode != 0 or line is None:
        tail = (run.stderr or run.stdout).strip().splitlines()[-15:]
        print(f"{mode}{where}: failed ({run.returncode})\n" + "\n".join(tail), flush=True)
        rec.record(mode, wl, run.values(), status="failed",
                   reason=" | ".join(tail[-3:])[:2000] or f"exit status {run.returncode}", repeat=repeat)
        return False
    raw = json.loads(line)
    v = values_of(run, raw, a, wl["ranks"])
    rec.record(mode, wl, v, repeat=repeat, extra={"raw": raw})
    nan = float("nan")
    vram = "" if a.device == "cpu" else (f", VRAM per GPU {v.get('vram_device_peak_gib', nan):.1f} GiB (device), "
                                         f"{v.get('vram_torch_peak_gib', nan):.1f} (torch)")
    print(f"{mode}{where}: {v['step_s']:.3f} s/step, {v['tokens_per_s']:.0f} tokens/s, host PSS peak "
          f"{v.get('host_pss_peak_gib', nan):.1f} GiB (steps {v.get('host_pss_steps_peak_gib', nan):.1f}; ranks "
          f"{v.get('trainer_pss_peak_gib', nan):.1f}, tsd {v.get('tsd_pss_peak_gib', 0):.2f}){vram}, "
          f"losses {raw['losses'][0]:.4f} -> {raw['losses'][-1]:.4f}", flush=True)
    return True


def continued_order(paths: list[str], run_id: str) -> int:
    """The `order` the next record of run `run_id` takes: after its records in the results files
    `paths` (the run's own results file, and bench/results/dp.jsonl where the records of an earlier
    command on another machine were appended). Exits with a message if none holds the run."""
    return max(r["order"] for r in benchlib.run_records(paths, run_id, "dp_bench")) + 1


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.mode:
        launch(a)
        return 0
    counts, beyond = configurations(a, visible_gpus() if a.device == "cuda" else 0)
    rec = benchlib.Recorder("dp", a.results, run_id=a.run_id)
    if a.run_id:
        rec.order = continued_order([rec.path, os.path.join(benchlib.RESULTS_DIR, "dp.jsonl")], a.run_id)
    nvml = benchlib.Nvml.open() if a.device == "cuda" else None
    failed = 0
    for repeat in range(a.repeats):
        for gpus in counts:
            for mode in a.modes_list:
                if gpus in beyond:
                    if repeat == 0:
                        rec.record(mode, workload(a, mode, gpus), {}, status="skipped", reason=beyond[gpus])
                    continue
                failed += not run_one(a, rec, nvml, mode, gpus, repeat)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
