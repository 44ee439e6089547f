"""Two LoRA jobs on one GPU sharing a base in VRAM through tsd's device copies (issue 12's
"gpu_stores" benchmark; docs/stores.md, "Device copies").

    python3 bench/gpu_stores_bench.py --tsd-bin build/bin/tsd [--layers 48] [--seq 512] [--results F]

It writes a random checkpoint of the Qwen2.5-14B architecture once (bf16; `--layers` fewer for a
quicker run), starts a tsd of its own with `gpu_stores = true`, and measures whole-device VRAM
(NVML) in three phases, each job training `--steps` LoRA steps (r=16 on every projection, AdamW
in tsd, batch 1 x `--seq`) with its NF4 base from the store:

  1. job A with the device copy (tsd makes the copy): one job's VRAM (`one_job`);
  2. job B with the device copy beside A: both jobs' VRAM (`both`);
  3. after both exited, job C loading the same base privately (host store, copied to its own
     VRAM): a job's own memory without the base is C's VRAM less the base's bytes (`own`).

Pass: both <= one_job + own + 5% of one_job, i.e. the base is held once. Also checked: every
job's losses are equal (the same codes, the same kernels). One record per run goes to
bench/results/gpu_stores.jsonl (bench/benchlib.py); without a GPU the record says skipped.

The worker half (`--worker`) is also what tests/python/test_gpu_stores.py runs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib  # noqa: E402

# Qwen2.5-14B.
QWEN14B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
               num_key_value_heads=8, vocab_size=152064)


def write_checkpoint(directory: str, seed: int = 0, **arch: Any) -> int:
    """A random bf16 Qwen2 checkpoint (config.json, model.safetensors) in `directory`; returns the
    bytes of its quantizable linear weights' NF4 codes and absmax (the base a store holds in VRAM)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=False, **arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors, base = {}, 0
    for name, p in model.state_dict().items():
        t = torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        tensors[name] = t
        if name.endswith("_proj.weight") and ".layers." in name:
            base += (t.numel() + 1) // 2 + 4 * ((t.numel() + 63) // 64)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(directory)
    return base


def _lora(model: Any, steps: int, seq: int, vocab: int, state: dict[str, Any], device: str) -> list[float]:
    import torch
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(3)).to(device)
    losses = []
    for _ in range(steps):
        loss = state["model"](input_ids=ids, labels=ids).loss
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        losses.append(loss.item())
    if device != "cpu":
        torch.cuda.synchronize()
    return losses


def worker(socket: str, path: str, job: str, mode: str, seq: int) -> None:
    """One trainer: loads `path` NF4 through a tsd store, puts the base on the GPU (`mode`
    "device": the shared copy; "host": a private copy) or keeps it in the host store ("cpu": a
    CPU run, for a smoke test of bench/stores_bench.py), then obeys stdin lines: "train N" (N LoRA
    steps; prints {"losses": [...]}) and "exit". Prints {"loaded": {...}} once ready, with the
    seconds `load_model` took (`load_s`)."""
    import peft
    import torch

    import trainstream
    from trainstream.integrations.huggingface import load_model
    from trainstream.store import use_device_copy

    client = trainstream.connect(socket=socket, job=f"{job}-store")
    t0 = time.time()
    model = load_model(path, quantize="nf4", dtype=torch.bfloat16, store=client)
    info: dict[str, Any] = {"store": model._ts_load_info["store"], "mode": mode, "pid": os.getpid(),
                            "load_s": time.time() - t0}
    device = "cpu" if mode == "cpu" else "cuda:0"
    if mode == "device":
        dev = use_device_copy(model, "cuda:0")
        info.update(read_only=dev.read_only, access_note=dev.access_note, gpu_uuid=dev.gpu_uuid)
    model.to(device)
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device=device, socket=socket, job=job)
    state = {"model": model, "opt": opt}
    vocab = int(model.config.vocab_size)
    print(json.dumps({"loaded": info}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "train":
            losses = _lora(model, int(cmd[1]), seq, vocab, state, device)
            reserved = torch.cuda.memory_reserved() if device != "cpu" else 0
            print(json.dumps({"losses": losses, "reserved": reserved}), flush=True)
    trainstream.unwrap(model)
    client.close()


class Job:
    """A worker process driven line by line."""

    def __init__(self, socket: str, path: str, job: str, mode: str, seq: int) -> None:
        # stderr to a file: a pipe nobody drains would stall a chatty worker.
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", socket, path, job, mode,
                                      str(seq)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True)
        self.name = job
        self.loaded = self._read("loaded")

    def _read(self, key: str, timeout: float = 900) -> Any:
        deadline = time.time() + timeout
        assert self.proc.stdout is not None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                err = self.err.read()
                raise RuntimeError(f"job {self.name} ended before '{key}': {err[-3000:]}")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in msg:
                return msg[key]
        raise RuntimeError(f"job {self.name}: no '{key}' within {timeout} s")

    def train(self, steps: int) -> list[float]:
        self.start_training(steps)
        return self.losses()

    def start_training(self, steps: int) -> None:
        """Asks for `steps` LoRA steps without waiting (several jobs then train at once)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"train {steps}\n")
        self.proc.stdin.flush()

    def losses(self) -> list[float]:
        """The losses of the steps asked last."""
        return [float(x) for x in self._read("losses")]

    def exit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def stop_all(jobs: list[Job], tsd: subprocess.Popen[bytes]) -> None:
    """Kills the jobs still running, then stops the benchmark's tsd."""
    for j in jobs:
        j.kill()
    tsd.send_signal(signal.SIGTERM)
    tsd.wait(60)


def device_used(nvml: Any, settle_s: float = 1.0) -> int:
    """Whole-device used bytes, read after `settle_s` (freed memory shows up late in NVML)."""
    time.sleep(settle_s)
    used = nvml.used_bytes(benchlib.Nvml.index_for_visible())
    if used is None:
        raise RuntimeError("NVML gives no memory figure for the GPU")
    return int(used)


def copies_of(socket: str, store: int) -> list[Any]:
    import trainstream
    with trainstream.connect(socket=socket) as c:
        return [list(s.device_copies) for s in c.stores() if s.id == store][0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    nvml = benchlib.Nvml.open()
    if nvml is None:
        return {"status": "skipped", "reason": "no NVIDIA driver (NVML) here"}
    arch = dict(QWEN14B, num_hidden_layers=args.layers)
    work = args.workdir or tempfile.mkdtemp(prefix="tsd-gpu-stores-")
    ckpt = os.path.join(work, f"qwen14b-L{args.layers}")
    t0 = time.time()
    if not os.path.exists(os.path.join(ckpt, "model.safetensors")):
        base = write_checkpoint(ckpt, **arch)
        with open(os.path.join(ckpt, "base_bytes"), "w") as f:
            f.write(str(base))
    with open(os.path.join(ckpt, "base_bytes")) as f:
        base = int(f.read())
    print(f"checkpoint ready in {time.time() - t0:.0f} s (NF4 base {base / 2**30:.2f} GiB)", flush=True)
    tsd, sock = benchlib.start_tsd(args.tsd_bin, work, "90%", "--gpu-stores", "--store-keep", "10m")
    jobs: list[Job] = []
    try:
        u0 = device_used(nvml)
        a = Job(sock, ckpt, "gs-a", "device", args.seq)
        jobs.append(a)
        la = a.train(args.steps)
        u1 = device_used(nvml)
        b = Job(sock, ckpt, "gs-b", "device", args.seq)
        jobs.append(b)
        lb = b.train(args.steps)
        u2 = device_used(nvml)
        copies = copies_of(sock, int(a.loaded["store"]))
        a.exit()
        b.exit()
        u3 = device_used(nvml)
        c = Job(sock, ckpt, "gs-c", "host", args.seq)
        jobs.append(c)
        lc = c.train(args.steps)
        u4 = device_used(nvml)
        c.exit()
    finally:
        stop_all(jobs, tsd)
    one_job, both, own = u1 - u0, u2 - u0, (u4 - u3) - base
    limit = one_job + own + 0.05 * one_job
    gib = 2.0 ** 30
    return {"status": "ok", "workload": {"arch": "Qwen2.5-14B", "layers": args.layers, "batch": 1, "seq": args.seq,
                                         "quantize": "nf4", "lora_r": 16, "steps": args.steps},
            "values": {"base_gib": base / gib, "one_job_vram_gib": one_job / gib, "both_vram_gib": both / gib,
                       "own_vram_gib": own / gib, "limit_vram_gib": limit / gib,
                       "second_job_added_gib": (u2 - u1) / gib, "host_job_vram_gib": (u4 - u3) / gib,
                       "pass": int(both <= limit), "losses_equal": int(la == lb == lc),
                       "read_only": int(bool(a.loaded.get("read_only"))), "device_copies": len(copies)},
            "raw": {"u": [u0, u1, u2, u3, u4], "losses": [la, lb, lc], "copies": [c.__dict__ for c in copies],
                    "access_note": a.loaded.get("access_note", "")}}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        socket, path, job, mode, seq = sys.argv[2:7]
        worker(socket, path, job, mode, int(seq))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tsd-bin", default=os.environ.get("TSD_BIN", os.path.join(HERE, "..", "build", "bin", "tsd")))
    ap.add_argument("--layers", type=int, default=48, help="decoder layers (48: the whole 14B architecture)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (kept for reruns)")
    ap.add_argument("--results", default=None, help="results file (default bench/results/gpu_stores.jsonl)")
    args = ap.parse_args()
    out = run(args)
    print(json.dumps(out, indent=1, default=str), flush=True)  # the figures, whatever the recording does
    rec = benchlib.Recorder("gpu_stores", results=args.results)
    if out["status"] != "ok":
        rec.record("two_jobs_device_copy", {"layers": args.layers}, {}, status="skipped", reason=out["reason"])
        print(json.dumps(out))
        return 0
    rec.record("two_jobs_device_copy", out["workload"], out["values"], extra={"raw": out["raw"]})
    print(json.dumps(out["values"], indent=1))
    return 0 if out["values"]["pass"] and out["values"]["losses_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
