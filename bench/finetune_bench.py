"""Fine-tuning through tsd against its peers, on the same workloads, into the benchmark pipeline
(bench/results/finetune.jsonl; bench/report.py makes docs/benchmarks.md from it).

Modes, each run in its own process so peaks do not mix:
  tsd         full fine-tune, fp32 weights on the GPU, bf16 autocast; AdamW in tsd (trainstream.wrap, offload=True)
  tsd_bf16    the same with param_dtype=torch.bfloat16: bf16 working copies on the GPU, fp32 masters in tsd
              (what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) does), bf16 autocast kept
  tsd_bf16m   tsd_bf16 with bf16 moments (stochastic rounding) instead of --moment-dtype
  tsd_bf16_act, tsd_bf16m_act   those with activation_offload=--activation-offload (a share of the
              decoder layers whose saved activations are paged to host memory)
  tsd_lora    peft LoRA r=16 on a bf16 base; the LoRA parameters' AdamW in tsd
  tsd_qlora   the same on an NF4 base (trainstream.quantize_model, block 64, bf16 compute)
  bnb_qlora   peft + bitsandbytes QLoRA, the peer of tsd_qlora: the block stack's linear layers as
              bitsandbytes Linear4bit (NF4, block 64, no double quantization, bf16 compute; what
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
              bnb_4bit_compute_dtype=bfloat16) makes), LoRA r=16, torch AdamW on the GPU
  lora_torch  stock peft LoRA r=16 on the bf16 base tsd_lora builds (on the GPU, honouring --grad-ckpt),
              torch AdamW on the GPU: tsd_lora's peer where peers.py's lora_stock cannot checkpoint
  stock, fsdp2_offload, lora_stock     the peers of shared/bench/peers.py (fused AdamW in VRAM,
              FSDP2 + CPUOffloadPolicy, stock LoRA)
  ds_offload, torchao_offload          the peers of shared/bench/offload_peers.py (DeepSpeed ZeRO-2
              with offload_optimizer=cpu, torchao CPUOffloadOptimizer)
A mode written MODE:uncapped ignores --cap-gib (the same configuration uncapped, in the same run);
MODE:cap=G and MODE:clip=X run that entry under a G GiB cap or with max_grad_norm X (a budget
sweep, or both clippings, in one interleaved run: tsd_bf16_act:cap=12,tsd_bf16_act:cap=24,stock);
MODE:overlap=on|off and MODE:gpu=F|auto override --overlap and --gpu-fraction for that entry, and
MODE:alloc=expandable runs it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and a tsd
mode's MODE:threads=N runs against a tsd of its own started with --optimizer-threads N, MODE:ckpt
turns on the model's gradient checkpointing for that entry and an *_act mode's MODE:recompute=V
passes wrap(activation_recompute=V) (variants chain: tsd_bf16_act:overlap=off:gpu=auto), so
settings compare side by side in one run.
--param-offload (auto, true, or a fraction) pages the tsd modes' block weights through tsd
(wrap(param_offload=...)); the model is then built on the host (random weights drawn on the GPU one
tensor at a time; in bf16 for the modes that train bf16 weights, as a checkpoint loaded with
torch_dtype=bfloat16 is) and handed to wrap() there, as a model bigger than the card would be.
--grad-ckpt turns on the model's gradient checkpointing in every transformers mode (as people
fine-tuning large bases run it). Every mode clips by the global gradient norm (--clip, default 1.0 as in every Hugging Face run;
--clip 0 turns it off). --overlap on|off sets the tsd modes' wrap(overlap_forward=...) (on: updates finish
during the next forward, so the wait moves from step() into the forward; default off). --gpu-fraction
(a number in [0, 1], or auto) sets the tsd modes' wrap(optimizer_gpu_fraction=...): that share of the
parameters keeps its optimizer on the GPU (default 0: all in tsd). Models come from a config with random weights (no download); `--arch tiny`
is a small plain-torch model (bench/tiny_lm.py) for a CPU run (`--device cpu`, tsd modes only).

    python3 bench/finetune_bench.py [--arch qwen1.5b] [--batch 8] [--seq 512] [--steps 6] [--clip 1.0]
        [--modes tsd_bf16_act,stock,fsdp2_offload,ds_offload,torchao_offload] [--repeats 3] [--once stock]
        [--cap-gib N] [--socket PATH | --pool-size 96GiB --daemon-args "..."] [--peers DIR] [--results FILE]

--repeats N runs every mode N times, interleaved (A B C A B C ...), so a ratio can be the median of
N runs; --once names modes run only in the first round. --run-id RUN_ID (or last) continues a run
begun by an earlier command, whose records are in --results or --prior (one interleaved run split
over calls to the GPU machine): the new rounds are numbered after its rounds, and STREAM and the
--once modes are not run again. A peer that is not installed (or a mode
that needs a GPU on --device cpu) is recorded as skipped with the reason. Without --socket it starts
build/bin/tsd (--tsd-bin) on a private socket with --pool-size. Each measured run becomes one record:
step times (the median of the settled steps: from the third, or from the first after tsd's last
"auto" decision from measured steps, whichever is later; and the drained window, the settled
steps' wall time with the last one's updates completed, per step), peak VRAM from torch (max_memory_allocated) and for the whole
device (NVML, sampled, less what was in use before), host memory as PSS of the trainer plus tsd
(sampled; tsd's regions counted once) beside tsd's own used_bytes, peak RSS (wait4), and for tsd
modes where a step's time goes (GPU forward and backward from CUDA events, the wall time step()
waits for the daemon). A table of this run is printed at the end.

Host side (bench/stream.py): tsd modes record the host memory bytes per trained parameter per step
(AdamW's reads and writes, clipping's second read of the gradients, the PCIe copies, from the
dtypes) and the paging traffic; on a GPU run with tsd modes (or with --stream on), bench/stream_bench
(--stream-bin; beside the tsd binary or in build/bin) measures the host's STREAM bandwidth with
non-temporal stores in the same run (recorded as mode "stream"), and the end prints each tsd mode's
bound, max(GPU forward + backward, host bytes per step / STREAM). On a GPU, bench/pcie_bench.py also
measures the PCIe bandwidth (pinned copies each way and both at once; recorded as mode "pcie"), and
each tsd mode records its PCIe bytes per step (gradients down, updated weights up, the activation
and weight pages), so the bound gains a PCIe term (`bound_pcie_s`), the part a run under a tight
budget is bound by. Each tsd mode also records how long tsd's threads worked on its updates per step
(`tsd_busy_s`: JobActivity.work_busy_s over the drained window, per step and thread) and the window
less that (`tsd_idle_s`), and where that idle time fell (`tsd_gaps`, bench/tsd_timeline.py: the
stretches with no update under way, from the control page's per-bucket stamps, by the trainer's
phase: forward, backward, step(), between steps, the final drain). --loader-workers N feeds the random tokens
through a torch DataLoader with N worker processes (the tsd modes' step then includes waiting for
it, recorded as data_wait_ms), to measure a trainer whose loader workers share the CPUs with tsd.

This file runs the modes and records them; finetune_modes.py says what the modes and an entry's
variants are, finetune_model.py builds the models, and finetune_child.py is one measured mode in
its own process (this script with --mode).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import finetune_daemons  # noqa: E402
import stream  # noqa: E402
from finetune_child import run_capped, run_tsd_mode  # noqa: E402
from finetune_modes import (ALL_MODES, DTYPES, OFFLOAD_MODES, PEER_MODES, TINY, TSD_MODES,  # noqa: E402
                            base_mode, mode_settings, option_value, schedule, skip_reason)


def find_script(name: str, given: Optional[str]) -> Optional[str]:
    """A peer script: in --peers (a folder, or peers.py itself), ../shared/bench, .devdeps."""
    dirs = []
    if given:
        dirs.append(given if os.path.isdir(given) else os.path.dirname(os.path.abspath(given)))
    dirs += [os.path.join(ROOT, "..", "shared", "bench"), "/work/shared/bench", os.path.join(ROOT, ".devdeps")]
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.exists(p):
            return os.path.abspath(p)
    return None


def measure_stream(a: argparse.Namespace, rec: benchlib.Recorder, repeat: int = 0) -> Optional[dict[str, Any]]:
    """STREAM in this run (bench/stream_bench, non-temporal stores): recorded as mode "stream"
    (`repeat`: before the modes 0, after them 1), returned for the bounds; None (recorded as
    skipped) without the binary or when it fails."""
    binary = stream.find_binary(a.stream_bin, a.tsd_bin or os.environ.get("TSD_BIN"), ROOT)
    work = {"device": "host", "kernels": "copy,scale,add,triad; ordinary and non-temporal stores"}
    if binary is None:
        rec.record("stream", work, {}, status="skipped", reason="no stream_bench: build it (ninja stream_bench) "
                   "or pass --stream-bin", repeat=repeat)
        return None
    try:
        got = stream.measure(binary, array_mib=a.stream_mib)
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
        rec.record("stream", work, {}, status="failed", reason=str(e)[-1500:], repeat=repeat)
        return None
    values = {k: v for k, v in got.items() if k.endswith("_gbs")}
    values["bandwidth_gbs"] = stream.bandwidth_gbs(got)
    rec.record("stream", {**work, "threads": got.get("threads"), "array_mib": got.get("array_mib")}, values,
               extra={"raw": got}, repeat=repeat)
    print("@@" + json.dumps({"mode": "stream", **values}), flush=True)
    return values


def measure_pcie(rec: benchlib.Recorder) -> Optional[dict[str, Any]]:
    """PCIe bandwidth in this run (bench/pcie_bench.py in a process of its own, so this one holds
    no CUDA context): recorded as mode "pcie", returned for the bounds' PCIe term; None (recorded
    as failed) when it fails."""
    work = {"device": "pcie", "copies": "pinned host <-> device, each way and both at once"}
    argv = [sys.executable, os.path.join(ROOT, "bench", "pcie_bench.py")]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        if run.returncode != 0 or not lines:
            raise RuntimeError(f"exit status {run.returncode}: {(run.stderr or run.stdout).strip()[-500:]}")
        got = json.loads(lines[-1])
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
        rec.record("pcie", work, {}, status="failed", reason=str(e)[-1500:])
        return None
    values = {k: v for k, v in got.items() if k.endswith("_gbs")}
    rec.record("pcie", {**work, "mib": got.get("mib")}, values, extra={"raw": got})
    print("@@" + json.dumps({"mode": "pcie", **values}), flush=True)
    return values


def few_settled(vals: list[dict[str, Any]]) -> str:
    """A warning for a mode whose figures rest on fewer than 3 settled steps (its "auto" decisions
    took most of the run): how many steps to pass instead."""
    counts = [(len(v.get("step_s") or []) + 1 - int(v["first_settled_step"]), int(v["first_settled_step"]))
              for v in vals if isinstance(v.get("first_settled_step"), int)]
    if not counts or min(n for n, _ in counts) >= 3:
        return ""
    n, first = min(counts)
    return (f"; only {max(n, 0)} settled step(s) (the decisions took until step {first - 1}): "
            f"pass --steps {first + 3} or more")


def bound_lines(records: list[dict[str, Any]], measured: dict[str, Any],
                pcie: Optional[dict[str, Any]] = None) -> list[str]:
    """Each tsd mode's bound in this run: max(the GPU's forward + backward, its host bytes per step
    / the STREAM bandwidth), beside its measured step (medians over the run's repeats). The GPU part
    is stock's forward + backward when its records carry them, else stock's whole step (peers.py
    times only that), else the mode's own (CUDA events). With `pcie` (pcie_bench's figures), also
    the step's PCIe copies at those bandwidths and the bound with that term."""
    def median(xs: list[float]) -> Optional[float]:
        return sorted(xs)[len(xs) // 2] if xs else None

    def fwd_bwd(vals: list[dict[str, Any]]) -> Optional[float]:
        return median([(v["gpu_forward_ms"] + v["gpu_backward_ms"]) / 1e3 for v in vals
                       if "gpu_forward_ms" in v and "gpu_backward_ms" in v])

    ok = [r for r in records if r.get("status") == "ok"]
    stock_fb = stream.stock_gpu_s([r["values"] for r in ok if r["mode"] == "stock"])
    bw = float(measured["bandwidth_gbs"])
    samples = measured.get("samples_gbs") or []
    seen = (f", the best of {len(samples)} measurements in the run: " + ", ".join(f"{x:.1f}" for x in samples)
            if len(samples) > 1 else "")
    out = [f"bound = max(GPU forward+backward ({'stock: %.3f s' % stock_fb if stock_fb else 'the mode own'}), "
           f"host bytes per step / STREAM {bw:.1f} GB/s{seen})"]
    for mode in dict.fromkeys(r["mode"] for r in ok if base_mode(r["mode"]) in TSD_MODES):
        vals = [r["values"] for r in ok if r["mode"] == mode and "host_bytes_per_step" in r["values"]]
        if not vals:
            continue
        host_bytes = median([v["host_bytes_per_step"] for v in vals]) or 0.0
        fb = stock_fb if stock_fb else (fwd_bwd(vals) or 0.0)
        bound = stream.bound_s(fb, host_bytes, bw)
        step = median([v["step_s_median"] for v in vals])
        window = median([v["step_s_window"] for v in vals if v.get("step_s_window") is not None])
        link = median([stream.pcie_s(v["pcie_h2d_bytes_per_step"], v["pcie_d2h_bytes_per_step"], pcie)
                       for v in vals if pcie and "pcie_h2d_bytes_per_step" in v])
        out.append(f"  {mode}: {vals[0]['host_bytes_per_param']} B/param, host {host_bytes / (bw * 1e9):.3f} s, "
                   f"GPU {fb:.3f} s, bound {bound:.3f} s"
                   + (f", step {step:.3f} s ({step / bound:.2f}x the bound)" if step and bound else "")
                   + (f", window {window:.3f} s/step drained ({window / bound:.2f}x)" if window and bound else "")
                   + (f"; PCIe {link:.3f} s, with it the bound is {max(bound, link):.3f} s" if link is not None else "")
                   + few_settled(vals))
        gap = median([v["tsd_gap_ms"] for v in vals if v.get("tsd_gap_ms") is not None])
        if gap is not None:  # where tsd's threads had no update under way (tsd_timeline.py)
            parts = [(name, median([v[f"tsd_gap_{name}_ms"] for v in vals if f"tsd_gap_{name}_ms" in v]))
                     for name in ("forward", "backward", "step", "between")]
            out.append(f"    no update under way {gap:.0f} ms/step: "
                       + ", ".join(f"{name} {ms:.0f}" for name, ms in parts if ms is not None))
    return out


def child_argv(mode: str, a: argparse.Namespace, socket: Optional[str] = None) -> list[str]:
    """The command of one --modes entry's child; `socket` is the tsd a tsd mode's child attaches to."""
    entry = mode
    mode, a = mode_settings(mode, a)
    common = ["--arch", a.arch, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
    clip = ["--clip", str(a.clip)] if a.clip else []
    if mode in PEER_MODES:
        return [sys.executable, a.peers, mode, *common, *clip, *(["--cap-gib", str(a.cap_gib)] if a.cap_gib else [])]
    if mode in OFFLOAD_MODES:
        if a.cap_gib:
            return [sys.executable, os.path.abspath(__file__), "--run-capped", str(a.cap_gib), a.offload_peers, mode,
                    *common, *clip]
        return [sys.executable, a.offload_peers, mode, *common, *clip]
    return [sys.executable, os.path.abspath(__file__), "--mode", mode, "--socket", socket or a.socket or "", "--device", a.device,
            *(["--grad-ckpt"] if a.grad_ckpt else []),
            "--moment-dtype", a.moment_dtype, "--activation-offload", str(a.activation_offload),
            "--activation-recompute", str(a.activation_recompute),
            "--clip", str(a.clip), "--overlap", a.overlap, *common, *(["--peers", a.peers] if a.peers else []),
            *(["--param-offload", a.param_offload] if a.param_offload else []), "--offload", a.offload,
            *(["--load-model"] if a.load_model else []), *(["--save-restore"] if a.save_restore else []),
            *(["--profile-step", str(a.profile_step)] if a.profile_step else []), "--entry", entry,
            *(["--cap-gib", str(a.cap_gib)] if a.cap_gib else []), "--gpu-fraction", a.gpu_fraction,
            *(["--loader-workers", str(a.loader_workers)] if a.loader_workers else [])]


def workload(mode: str, a: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    mode, a = mode_settings(mode, a)
    w: dict[str, Any] = {"arch": a.arch, "params": raw.get("params"), "batch": a.batch, "seq": a.seq, "steps": a.steps,
                         "device": a.device, "dtype": DTYPES.get(mode, "") if a.device == "cuda" else "fp32",
                         "clip": a.clip, "vram_cap_gib": a.cap_gib, **({"grad_ckpt": True} if a.grad_ckpt else {}),
                         **({"alloc_conf": conf} if (conf := getattr(a, "alloc_conf", None)
                                                     or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) else {})}
    if mode in TSD_MODES:
        w.update(moment_dtype=raw.get("moments", a.moment_dtype), param_dtype=raw.get("param_dtype"),
                 activation_offload=raw.get("activation_offload"), tsd_isa=raw.get("isa"),
                 **({"activation_recompute": raw.get("activation_recompute")}
                    if raw.get("activation_recompute") not in (None, False) else {}),
                 tsd_threads=raw.get("threads"), daemon_args=a.daemon_args, overlap_forward=a.overlap,
                 **({"param_offload": raw.get("param_offload")} if a.param_offload else {}),
                 **({"offload": a.offload} if a.offload != "true" else {}),
                 **({"load_model": True} if a.load_model and mode in ("tsd_lora", "tsd_qlora") else {}),
                 **({"optimizer_gpu_fraction": a.gpu_fraction} if a.gpu_fraction not in ("0", "0.0") else {}),
                 **({"loader_workers": a.loader_workers} if a.loader_workers else {}))
    return w


VALUE_KEYS = {"step_s_median": "step_s_median", "steps": "step_s", "step_s_window": "step_s_window",
              "tsd_busy_s": "tsd_busy_s", "tsd_idle_s": "tsd_idle_s",
              "tsd_gap_ms": "tsd_gap_ms", "tsd_gap_forward_ms": "tsd_gap_forward_ms",
              "tsd_gap_backward_ms": "tsd_gap_backward_ms", "tsd_gap_step_ms": "tsd_gap_step_ms",
              "tsd_gap_between_ms": "tsd_gap_between_ms", "tsd_gap_drain_ms": "tsd_gap_drain_ms",
              "pcie_h2d_bytes_per_step": "pcie_h2d_bytes_per_step", "pcie_d2h_bytes_per_step": "pcie_d2h_bytes_per_step",
              "settled_after": "settled_after", "first_settled_step": "first_settled_step", "peak_gib": "vram_torch_peak_gib",
              "tsd_gib": "tsd_used_gib", "setup_s": "setup_s", "loss": "loss", "gpu_forward_ms": "gpu_forward_ms",
              "gpu_backward_ms": "gpu_backward_ms", "step_call_ms": "step_wait_ms",
              "paged_gib_per_step": "paged_gib_per_step", "grad_norms": "grad_norms",
              "paged_blocks": "paged_blocks", "reserved_peak_gib": "vram_torch_reserved_gib", "alloc_retries": "alloc_retries",
              "host_bytes_per_param": "host_bytes_per_param", "host_bytes_per_step": "host_bytes_per_step",
              "data_wait_ms": "data_wait_ms", "unwrap_s": "unwrap_s", "unwrap_failed": "unwrap_failed",
              "save_s": "save_s", "restore_s": "restore_s", "saved_gib": "saved_gib", "resume_exact": "resume_exact",
              "save_rss_anon_growth_mib": "save_rss_anon_growth_mib",
              "restore_rss_anon_growth_mib": "restore_rss_anon_growth_mib",
              "host_pss_before_wrap_gib": "host_pss_before_wrap_gib", "check_memory_host_gib": "check_memory_host_gib",
              "check_memory_room_gib": "check_memory_room_gib", "build_s": "build_s", "wrap_s": "wrap_s"}


def outcome(run: benchlib.ChildRun, tsd_pss_before: Optional[int] = None
            ) -> tuple[str, Optional[str], dict[str, Any], dict[str, Any]]:
    """(status, reason, values, raw line) of a finished child. With `tsd_pss_before` (the
    daemon's PSS before the child started) and the child's check_memory figures, the values
    carry the host bound check_memory implied (`host_check_bound_gib`: the trainer before wrap()
    plus tsd before the run plus the host_bytes it computed) and whether the sampled host peak
    stayed within it (`host_within_check`, 1 or 0)."""
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("@@")]
    if run.returncode != 0 or not lines:
        text = (run.stderr or run.stdout or f"exit status {run.returncode}").strip()
        missing = re.findall(r"ModuleNotFoundError: No module named '([^']+)'", text)
        if missing:
            return "skipped", f"{missing[-1]} is not installed", {}, {}
        return "failed", text[-1500:], {}, {}
    raw = json.loads(lines[-1][2:])
    values = {VALUE_KEYS[k]: v for k, v in raw.items() if k in VALUE_KEYS and v is not None}
    values.update(run.values())
    if tsd_pss_before is not None and "check_memory_host_gib" in values and "host_pss_peak_gib" in values:
        bound = values["host_pss_before_wrap_gib"] + tsd_pss_before / 2**30 + values["check_memory_host_gib"]
        values["host_check_bound_gib"] = bound
        values["host_within_check"] = int(values["host_pss_peak_gib"] <= bound)
    return "ok", None, values, raw


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen1.5b", help="an architecture of peers.py (qwen0.5b ... qwen32b), or tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--clip", type=float, default=1.0, help="max_grad_norm for every mode (default 1.0; 0 turns it off)")
    ap.add_argument("--gpu-fraction", default="0",
                    help="tsd modes: wrap(optimizer_gpu_fraction=...): the share of the parameters whose optimizer "
                         "stays on the GPU, a number in [0, 1] or auto (default 0: all in tsd)")
    ap.add_argument("--overlap", default="off", choices=["on", "off"],
                    help="tsd modes: wrap(overlap_forward=...): updates finish during the next forward (on) or in step() (off)")
    ap.add_argument("--cap-gib", type=float, default=0, help="VRAM cap for every mode (set_per_process_memory_fraction)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in every transformers mode")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: tsd modes only, for a smoke run")
    ap.add_argument("--modes", default="tsd_bf16_act,stock,fsdp2_offload,ds_offload,torchao_offload")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all modes, interleaved (3 for a ratio within 10%%)")
    ap.add_argument("--once", default="", help="modes run only in the first round (e.g. stock, for its peak VRAM)")
    ap.add_argument("--moment-dtype", default="auto")
    ap.add_argument("--activation-offload", default="0.25",
                    help="share of the decoder layers the *_act modes page, or auto (default 0.25)")
    ap.add_argument("--activation-recompute", default="auto",
                    help="the *_act modes' wrap(activation_recompute=): auto (default, as wrap()'s: recompute the "
                         "blocks activation_offload=auto keeps paging once its plan settles; with another "
                         "--activation-offload, false), false (keep paging: the default until 2026-12-07, which earlier "
                         "records ran with), true or a fraction")
    ap.add_argument("--offload", default="true",
                    help="the tsd modes' wrap(offload=): true (default: the optimizer always in tsd) or auto (wrap's "
                         "default: stock AdamW on the GPU after two steps when it fits, e.g. LoRA adapters)")
    ap.add_argument("--param-offload", default="",
                    help="the tsd modes' wrap(param_offload=): auto, true or a fraction (default: off)")
    ap.add_argument("--profile-step", type=int, default=0,
                    help="tsd and local modes: profile this step (1-based) with torch.profiler, print its top operations "
                         "to stderr and write a Chrome trace to $TSD_BENCH_PROFILE_DIR; the step is left out of "
                         "the figures (default 0: none)")
    ap.add_argument("--entry", default="", help=argparse.SUPPRESS)  # a child's --modes entry, for file names
    ap.add_argument("--save-restore", action="store_true",
                    help="tsd modes: after the timed steps, save model and optimizer state streaming, train 2 steps, "
                         "restore, train the same 2 steps again and record whether the losses are bit-identical")
    ap.add_argument("--load-model", action="store_true",
                    help="tsd_lora/tsd_qlora build their base with trainstream.load_model(random_weights=True), "
                         "as users load one (quantized weights in tsd memory), instead of quantize_model")
    ap.add_argument("--socket", default=None, help="an existing tsd (default: start build/bin/tsd)")
    ap.add_argument("--tsd-bin", default=None, help="the tsd to start (default $TSD_BIN, else build/bin/tsd)")
    ap.add_argument("--pool-size", default="96GiB")
    ap.add_argument("--daemon-args", default="", help="more arguments for the tsd this script starts")
    ap.add_argument("--peers", default=None, help="the folder of peers.py and offload_peers.py (or peers.py itself)")
    ap.add_argument("--results", default=None, help="results file (default bench/results/finetune.jsonl)")
    ap.add_argument("--run-id", default=None,
                    help="continue run RUN_ID (or last: the newest run of --prior) instead of starting one: its "
                         "records are read from the results file and --prior, this command's rounds are numbered "
                         "after its rounds, and neither STREAM nor the --once modes run again (one interleaved run "
                         "split over calls; pass the same workload)")
    ap.add_argument("--prior", default=os.path.join(benchlib.RESULTS_DIR, "finetune.jsonl"),
                    help="with --run-id: another results file holding the run's earlier records "
                         "(default bench/results/finetune.jsonl)")
    ap.add_argument("--sample-interval", type=float, default=0.5, help="seconds between memory samples (default 0.5)")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="tsd modes: feed the random tokens through a torch DataLoader with N worker processes "
                         "(default 0: one batch kept on the device)")
    ap.add_argument("--stream", default="auto", choices=["auto", "on", "off"],
                    help="measure the host's STREAM bandwidth once, before the modes (auto: on a GPU run with tsd modes)")
    ap.add_argument("--stream-bin", default=None,
                    help="bench/stream_bench (default: beside the tsd binary, else build/bin; absent: recorded as skipped)")
    ap.add_argument("--stream-mib", type=int, default=512, help="MiB of each of STREAM's three arrays (default 512)")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # internal: run one tsd mode here
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    once = {m for m in a.once.split(",") if m}
    bad = [m for m in modes + sorted(once) if base_mode(m) not in ALL_MODES]
    if a.mode is None and bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(ALL_MODES)}")
    for m in modes + sorted(once):
        try:
            mode_settings(m, a)
        except ValueError as e:
            ap.error(str(e))
    if not modes or a.repeats < 1 or a.steps < 1 or a.batch < 1 or a.seq < 2:
        ap.error("need at least one mode, --repeats >= 1, --steps >= 1, --batch >= 1 and --seq >= 2")
    if a.loader_workers < 0 or a.stream_mib < 1:
        ap.error("--loader-workers must be >= 0 and --stream-mib >= 1")
    if a.clip < 0 or a.cap_gib < 0 or a.sample_interval <= 0:
        ap.error("--clip and --cap-gib must be >= 0 and --sample-interval > 0")
    try:
        option_value(a.activation_offload), option_value(a.param_offload or "false"), option_value(a.activation_recompute)
        if option_value(a.offload) not in (True, "auto"):
            raise ValueError("--offload")
    except ValueError:
        ap.error("--activation-offload, --activation-recompute and --param-offload take auto, true, false or a number; "
                 "--offload true or auto")
    a.modes_list, a.once_set = modes, frozenset(once)
    return a


def continue_run(a: argparse.Namespace, rec: benchlib.Recorder) -> list[dict[str, Any]]:
    """--run-id: the run's earlier records (from the results file and --prior); `rec` takes the
    run's id and the order after them. Exits if the run measured another workload."""
    prior = benchlib.run_records([rec.path, a.prior], a.run_id, "finetune_bench")
    rec.run_id = prior[0]["run_id"]
    rec.order = 1 + max(r["order"] for r in prior)
    keys = ("arch", "batch", "seq", "steps", "clip", "device")
    theirs = next((r["workload"] for r in prior if r["mode"] != "stream" and r["workload"].get("arch")), None)
    ours = {"arch": a.arch, "batch": a.batch, "seq": a.seq, "steps": a.steps, "clip": a.clip, "device": a.device}
    if theirs is not None and any(theirs.get(k) != ours[k] for k in keys):
        raise SystemExit(f"finetune_bench: --run-id {rec.run_id} measured " + ", ".join(
            f"{k} {theirs.get(k)}" for k in keys) + "; this command would measure " + ", ".join(
            f"{k} {ours[k]}" for k in keys) + ": pass the same workload, or start a run without --run-id")
    return prior


def main(argv: Optional[list[str]] = None) -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-capped" and argv is None:
        run_capped()
        return 0
    a = parse_args(argv)
    if a.arch != TINY:
        a.peers = find_script("peers.py", a.peers)
        a.offload_peers = find_script("offload_peers.py", a.peers)
    else:
        a.peers = a.offload_peers = None
    if a.mode:
        run_tsd_mode(a)
        return 0
    import report

    rec = benchlib.Recorder("finetune", a.results, command=benchlib.command_line(
        [os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd()), *(sys.argv[1:] if argv is None else argv)]))
    prior = continue_run(a, rec) if a.run_id else []
    first_round = 1 + max((r["repeat"] for r in prior), default=-1)
    skips = {m: skip_reason(base_mode(m), a) for m in a.modes_list}
    nvml = benchlib.Nvml.open() if a.device == "cuda" else None
    gpu = benchlib.Nvml.index_for_visible()
    daemons = finetune_daemons.Daemons(a)
    try:
        default = None
        if any(base_mode(m) in TSD_MODES and skips[m] is None for m in a.modes_list):
            default = daemons.get()
        want_stream = a.stream == "on" or (a.stream == "auto" and a.device == "cuda")
        if prior:  # the run's own STREAM, measured by the command that began it
            measured_stream = stream.best_of([r["values"] for r in prior if r["mode"] == "stream" and r["status"] == "ok"])
            measured_pcie = next((r["values"] for r in prior if r["mode"] == "pcie" and r["status"] == "ok"), None)
        else:
            measured_stream = measure_stream(a, rec) if default is not None and want_stream else None
            measured_pcie = measure_pcie(rec) if default is not None and want_stream and a.device == "cuda" else None
        for repeat, mode in schedule(a.modes_list, a.repeats, a.once_set, first_round):
            if skips[mode] is not None:
                if repeat == 0:
                    rec.record(mode, workload(mode, a, {}), {}, status="skipped", reason=skips[mode], repeat=repeat)
                    print(f"@@{json.dumps({'mode': mode, 'skipped': skips[mode]})}", flush=True)
                continue
            settings = mode_settings(mode, a)[1]
            tsd = daemons.get(getattr(settings, "daemon_threads", None)) if base_mode(mode) in TSD_MODES else None
            for d in daemons.by_threads.values():  # tsd frees a finished (or failed) child's job after it goes
                d.wait_idle()
            tsd_pss_before = benchlib.pss_bytes(tsd.pid) if tsd is not None else None
            conf = getattr(settings, "alloc_conf", None)
            run = benchlib.run_sampled(child_argv(mode, a, tsd.socket if tsd else None), a.sample_interval,
                                       tsd.pid if tsd else None,
                                       (lambda: tsd.client.status().used_bytes) if tsd else None, nvml, gpu,
                                       env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf) if conf else None)
            status, reason, values, raw = outcome(run, tsd_pss_before)
            if status == "failed":  # the whole traceback, for the log of the run
                print(f"{mode} failed; the end of its output:\n" + "\n".join(
                    (run.stderr or run.stdout).strip().splitlines()[-150:]), file=sys.stderr, flush=True)
            elif a.profile_step and "--profile-step:" in (run.stderr or ""):
                # The profiled step's tables, into the run's log as the child finishes (its files
                # may not come back from the machine that ran it).
                print(run.stderr[run.stderr.index("--profile-step:"):].rstrip(), file=sys.stderr, flush=True)
            rec.record(mode, workload(mode, a, raw), values, status=status, reason=reason, repeat=repeat,
                       extra={"raw": raw} if raw else None)
            print("@@" + json.dumps({"mode": mode, "repeat": repeat, "status": status, **(
                {"reason": reason[-300:]} if reason else {}), **values}), flush=True)
        if measured_stream is not None and not prior:
            # Once more after the modes: one measurement moves by a quarter from run to run on these
            # machines, and the bound takes the best the host showed (stream.best_of).
            measured_stream = stream.best_of([measured_stream, measure_stream(a, rec, repeat=1)])
    finally:
        daemons.close()
    if prior:  # the run's records from both files, each once
        records = benchlib.run_records([rec.path, a.prior], rec.run_id, "finetune_bench")
    else:
        records = [r for r in benchlib.read_results(rec.path) if r["run_id"] == rec.run_id]
    peers = ("fsdp2_offload", "ds_offload", "torchao_offload", "stock", "lora_stock", "bnb_qlora", "lora_torch")
    ratios = [f"step:{m}" for m in peers if m in a.modes_list]
    ratios += [f"vram:{m}" for m in ("stock", "lora_stock", "bnb_qlora", "lora_torch") if m in a.modes_list]
    block = report.Block("run", "modes", {"benchmark": ["finetune"], "run": [rec.run_id], "modes": [",".join(
        a.modes_list)], "cols": ["step,vram,vram_device,host,host_bound,tsd,rss,fwd,bwd,wait,window,busy,idle"], "ratio": ratios}, 0)
    print(f"\n{a.arch}, batch {a.batch}x{a.seq}, clip {a.clip:g}, {a.steps} steps (median of the settled steps), "
          f"{first_round + a.repeats} round(s); run {rec.run_id}, recorded in {os.path.relpath(rec.path)}\n")
    print(report.render_modes(block, records))
    if measured_stream:
        for line in bound_lines(records, measured_stream, measured_pcie):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
