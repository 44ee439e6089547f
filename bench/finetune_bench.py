"""Fine-tuning through tsd against its peers, on the same workloads (for docs/benchmarks.md).

Runs, each in its own process so peaks do not mix:
  tsd         full fine-tune, fp32 weights on the GPU, bf16 autocast; AdamW in tsd (trainstream.wrap, offload=True)
  tsd_bf16    the same with param_dtype=torch.bfloat16: bf16 working copies on the GPU, fp32 masters in tsd
              (what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) does), bf16 autocast kept
  tsd_bf16m   tsd_bf16 with bf16 moments (stochastic rounding) instead of --moment-dtype
  tsd_bf16_act, tsd_bf16m_act   those with activation_offload=--activation-offload (a share of the
              decoder layers whose saved activations are paged to pinned host memory)
  tsd_lora    peft LoRA r=16 on a bf16 base; the LoRA parameters' AdamW in tsd
and the peers of shared/bench/peers.py (stock fused AdamW in VRAM, FSDP2 + CPUOffloadPolicy,
stock LoRA). Models come from a config with random weights (no download).

    python3 bench/finetune_bench.py [--arch qwen1.5b] [--batch 8] [--seq 512] [--steps 6]
                                    [--modes tsd,stock,fsdp2_offload] [--socket PATH] [--pool-size 96GiB]
                                    [--peers PATH/TO/peers.py]

Without --socket it starts build/bin/tsd on a private socket with --pool-size (plus --daemon-args).
Prints one @@{json} line per mode and a table at the end: step time (median of steps 3+), peak VRAM,
the process's peak RSS (os.wait4; for tsd modes it includes the slots of tsd's regions the client
maps), the bytes tsd holds for the job, and for tsd modes where a step's time goes (GPU time of
forward and backward from CUDA events, the wall time step() waits for the daemon's last update).
Needs a GPU, transformers (and peft for the LoRA modes).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_MODES = ("stock", "fsdp2_offload", "lora_stock")


def find_peers(path):
    for p in (path, os.path.join(ROOT, "..", "shared", "bench", "peers.py"), "/work/shared/bench/peers.py"):
        if p and os.path.exists(p):
            return os.path.abspath(p)
    sys.exit("finetune_bench: peers.py not found; pass --peers")


def run_tsd_mode(a):
    """One tsd mode in this process; prints @@{json} like peers.py does."""
    import importlib.util

    import torch
    import trainstream
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = importlib.util.spec_from_file_location("peers", a.peers)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    torch.manual_seed(0)
    if a.cap_gib:
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    cfg = Qwen2Config(max_position_embeddings=4096, attn_implementation="sdpa", **peers.ARCH[a.arch])
    t0 = time.time()
    param_dtype = None
    moment_dtype = a.moment_dtype
    activation_offload = a.activation_offload if a.mode.endswith("_act") else False
    if a.mode in ("tsd", "tsd_bf16", "tsd_bf16m", "tsd_bf16_act", "tsd_bf16m_act"):
        model = Qwen2ForCausalLM(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        autocast = True
        if a.mode != "tsd":
            param_dtype = torch.bfloat16
        if a.mode.startswith("tsd_bf16m"):
            moment_dtype = "bfloat16"
    else:
        import peft
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).cuda()
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        autocast = False
    model, opt = trainstream.wrap(model, opt, device="cuda", socket=a.socket, offload=True,
                                  moment_dtype=moment_dtype, param_dtype=param_dtype,
                                  activation_offload=activation_offload)
    session = trainstream.unwrap_session(model)
    setup_s = time.time() - t0
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    times, fwd_ms, bwd_ms, step_ms = [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        ev[1].record()
        loss.backward()
        ev[2].record()
        ts = time.perf_counter()
        opt.step()
        step_ms.append((time.perf_counter() - ts) * 1e3)
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        fwd_ms.append(ev[0].elapsed_time(ev[1]))
        bwd_ms.append(ev[1].elapsed_time(ev[2]))
    med = sorted(times[2:])[len(times[2:]) // 2]

    def median(xs):
        return sorted(xs[2:])[len(xs[2:]) // 2]

    with trainstream.connect(socket=a.socket) as c:
        held = next(j for j in c.jobs() if j.name == session.client.job).used_bytes
    print("@@" + json.dumps(dict(mode=a.mode, arch=a.arch, params=sum(p.numel() for p in model.parameters()),
                                 batch=a.batch, seq=a.seq, step_s_median=med, steps=times,
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30, tsd_gib=held / 2**30,
                                 setup_s=setup_s, loss=loss.item(), moments=opt.moment_dtype,
                                 param_dtype=str(param_dtype), activation_offload=activation_offload,
                                 paged_gib_per_step=(session.pager.paged_bytes / a.steps / 2**30
                                                     if session.pager is not None else 0.0),
                                 gpu_forward_ms=median(fwd_ms),
                                 gpu_backward_ms=median(bwd_ms), step_call_ms=median(step_ms),
                                 isa=session.handle.isa, threads=session.handle.threads)), flush=True)
    trainstream.unwrap(model)


def run_child(args):
    """Runs one mode in a child process; its result with the child's peak RSS (from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("@@")]
    if proc.returncode != 0 or not lines:
        return {"error": (stderr or stdout)[-2000:]}
    r = json.loads(lines[-1][2:])
    r["peak_rss_gib"] = usage.ru_maxrss * 1024 / 2**30
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen1.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap-gib", type=float, default=0)
    ap.add_argument("--modes", default="tsd,stock,fsdp2_offload")
    ap.add_argument("--moment-dtype", default="auto")
    ap.add_argument("--activation-offload", type=float, default=0.25,
                    help="share of the decoder layers the *_act modes page (default 0.25)")
    ap.add_argument("--socket", default=None)
    ap.add_argument("--pool-size", default="96GiB")
    ap.add_argument("--daemon-args", default="", help="more arguments for the tsd this script starts")
    ap.add_argument("--peers", default=None)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: run one tsd mode here
    a = ap.parse_args()
    a.peers = find_peers(a.peers)
    if a.mode:
        return run_tsd_mode(a)

    daemon = None
    if a.socket is None:
        tmp = tempfile.mkdtemp(prefix="tsd-bench-")
        a.socket = os.path.join(tmp, "tsd.sock")
        daemon = subprocess.Popen([os.path.join(ROOT, "build", "bin", "tsd"), "--socket", a.socket, "--pool-size",
                                   a.pool_size, "--metrics-listen", "", *a.daemon_args.split()],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import trainstream
        for _ in range(200):
            try:
                trainstream.connect(socket=a.socket).close()
                break
            except trainstream.DaemonUnavailable:
                time.sleep(0.1)
    common = ["--arch", a.arch, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
    if a.cap_gib:
        common += ["--cap-gib", str(a.cap_gib)]
    results = []
    try:
        for mode in a.modes.split(","):
            if mode in PEER_MODES:
                r = run_child([sys.executable, a.peers, mode, *common])
            else:
                r = run_child([sys.executable, os.path.abspath(__file__), "--mode", mode, "--socket", a.socket,
                               "--peers", a.peers, "--moment-dtype", a.moment_dtype,
                               "--activation-offload", str(a.activation_offload), *common])
            r.setdefault("mode", mode)
            print("@@" + json.dumps(r), flush=True)
            results.append(r)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    print(f"\n{a.arch}, batch {a.batch}x{a.seq}, {a.steps} steps (median of steps 3+)")
    base = {r["mode"]: r for r in results if "error" not in r}
    print(f"{'mode':<16}{'s/step':>10}{'peak VRAM GiB':>16}{'RSS GiB':>10}{'tsd GiB':>10}{'x stock':>9}"
          f"{'x FSDP2':>9}{'VRAM/stock':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:<16}  failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ratio = lambda m, k: f"{r[k] / base[m][k]:.2f}" if m in base else "-"  # noqa: E731
        print(f"{r['mode']:<16}{r['step_s_median']:>10.3f}{r['peak_gib']:>16.1f}{r['peak_rss_gib']:>10.1f}"
              f"{r.get('tsd_gib', 0):>10.1f}{ratio('stock', 'step_s_median'):>9}"
              f"{ratio('fsdp2_offload', 'step_s_median'):>9}{ratio('stock', 'peak_gib'):>12}")


if __name__ == "__main__":
    main()
