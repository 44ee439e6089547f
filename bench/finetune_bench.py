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
MODE:overlap=on|off and MODE:gpu=F|auto override --overlap and --gpu-fraction for that entry, and
MODE:alloc=expandable runs it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (variants
chain: tsd_bf16_act:overlap=off:gpu=auto), so settings compare side by side in one run.
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
N runs; --once names modes run only in the first round. A peer that is not installed (or a mode
that needs a GPU on --device cpu) is recorded as skipped with the reason. Without --socket it starts
build/bin/tsd (--tsd-bin) on a private socket with --pool-size. Each measured run becomes one record:
step times (median of steps 3+), peak VRAM from torch (max_memory_allocated) and for the whole
device (NVML, sampled, less what was in use before), host memory as PSS of the trainer plus tsd
(sampled; tsd's regions counted once) beside tsd's own used_bytes, peak RSS (wait4), and for tsd
modes where a step's time goes (GPU forward and backward from CUDA events, the wall time step()
waits for the daemon). A table of this run is printed at the end.

Host side (bench/stream.py): tsd modes record the host memory bytes per trained parameter per step
(AdamW's reads and writes, clipping's second read of the gradients, the PCIe copies, from the
dtypes) and the paging traffic; on a GPU run with tsd modes (or with --stream on), bench/stream_bench
(--stream-bin; beside the tsd binary or in build/bin) measures the host's STREAM bandwidth with
non-temporal stores in the same run (recorded as mode "stream"), and the end prints each tsd mode's
bound, max(GPU forward + backward, host bytes per step / STREAM). --loader-workers N feeds the random tokens
through a torch DataLoader with N worker processes (the tsd modes' step then includes waiting for
it, recorded as data_wait_ms), to measure a trainer whose loader workers share the CPUs with tsd.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import runpy
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import benchlib  # noqa: E402
import stream  # noqa: E402

TSD_MODES = ("tsd", "tsd_bf16", "tsd_bf16m", "tsd_bf16_act", "tsd_bf16m_act", "tsd_lora", "tsd_qlora")
PEER_MODES = ("stock", "fsdp2_offload", "lora_stock")
OFFLOAD_MODES = ("ds_offload", "torchao_offload")
LOCAL_PEER_MODES = ("bnb_qlora", "lora_torch")  # peers run by this script (--mode), without tsd
ALL_MODES = TSD_MODES + PEER_MODES + OFFLOAD_MODES + LOCAL_PEER_MODES
LORA_MODES = ("tsd_lora", "tsd_qlora", "bnb_qlora", "lora_torch")
NEEDS = {"tsd_lora": ("peft",), "tsd_qlora": ("peft",), "lora_stock": ("peft",), "ds_offload": ("deepspeed",),
         "torchao_offload": ("torchao",), "bnb_qlora": ("peft", "bitsandbytes"), "lora_torch": ("peft",)}
# What each mode keeps in which precision (the workload's dtype).
DTYPES = {"tsd": "fp32 weights, bf16 autocast", "tsd_bf16": "bf16 weights, fp32 masters in tsd, bf16 autocast",
          "tsd_bf16m": "bf16 weights, fp32 masters in tsd, bf16 autocast",
          "tsd_bf16_act": "bf16 weights, fp32 masters in tsd, bf16 autocast",
          "tsd_bf16m_act": "bf16 weights, fp32 masters in tsd, bf16 autocast",
          "tsd_lora": "bf16 base, LoRA in tsd", "tsd_qlora": "NF4 base (tsd), bf16 compute, LoRA in tsd",
          "bnb_qlora": "NF4 base (bitsandbytes), bf16 compute, LoRA with torch AdamW on the GPU",
          "lora_torch": "bf16 base, LoRA with torch AdamW on the GPU", "stock": "fp32 weights, bf16 autocast",
          "fsdp2_offload": "fp32 sharded weights on the CPU, bf16 compute (MixedPrecisionPolicy)",
          "lora_stock": "bf16 base, LoRA in fp32", "ds_offload": "bf16 weights, fp32 master and moments on the CPU",
          "torchao_offload": "fp32 weights, bf16 autocast, fp32 moments on the CPU"}
TINY = "tiny"


def schedule(modes: list[str], repeats: int, once: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """The order of the runs: every mode in every round, interleaved (A B C A B C ...); the modes
    in `once` only in the first round."""
    return [(r, m) for r in range(repeats) for m in modes if r == 0 or m not in once]


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


def skip_reason(mode: str, a: argparse.Namespace) -> Optional[str]:
    """Why `mode` cannot run here (None if it can): a missing package or script, or no GPU."""
    if a.device == "cpu" and mode not in ("tsd", "tsd_bf16", "tsd_bf16m", "tsd_lora", "tsd_qlora"):
        return "needs a GPU (this run is --device cpu)"
    if a.arch == TINY and (mode not in TSD_MODES or mode in LORA_MODES):
        return "the peers and the LoRA modes run the Qwen architectures of peers.py, not --arch tiny"
    if mode in PEER_MODES and not a.peers:
        return "peers.py not found: pass --peers (shared/bench)"
    if mode in OFFLOAD_MODES and not a.offload_peers:
        return "offload_peers.py not found: pass --peers (the folder holding it)"
    if a.arch != TINY and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    for pkg in NEEDS.get(mode, ()):
        if importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed"
    if mode in TSD_MODES and importlib.util.find_spec("trainstream") is None:
        return "trainstream is not installed (pip install ./client-py)"
    return None


def build_model(a: argparse.Namespace, mode: str) -> tuple[Any, int]:
    """The model of --arch with random weights (seed 0) for `mode`, and its vocabulary size. The
    LoRA modes build their bf16 base on --device directly (a 14B base would take minutes and 59 GB
    in fp32 on the CPU), quantize it (tsd_qlora: trainstream; bnb_qlora: bitsandbytes) and add
    peft adapters r=16 on the attention projections."""
    import torch

    torch.manual_seed(0)
    if a.arch == TINY:
        from tiny_lm import TINY as cfg, TinyCausalLM

        return TinyCausalLM(**cfg), cfg["vocab_size"]
    spec = importlib.util.spec_from_file_location("peers", a.peers)
    peers = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(peers)  # type: ignore[union-attr]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(max_position_embeddings=4096, attn_implementation="sdpa", **peers.ARCH[a.arch])
    if a.load_model and mode in ("tsd_lora", "tsd_qlora"):
        model = loaded_model(cfg, mode, a.socket)
    elif host_built(a, mode):
        # bf16 where the run trains bf16 weights (a LoRA base; param_dtype=bf16), as a checkpoint
        # loaded with torch_dtype=bfloat16 is: an fp32 copy of a 7B model takes 28 GiB of the host
        # beside tsd's 85 GiB (bf16 moments), more than a 125 GiB host leaves check_memory's room
        # (90% of the available RAM) for.
        bf16 = mode in LORA_MODES or mode.startswith("tsd_bf16")
        model = host_model(cfg, torch.bfloat16 if bf16 else torch.float32, a.device)
    elif mode not in LORA_MODES:
        model = Qwen2ForCausalLM(cfg)
    else:
        with torch.device(a.device):
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = Qwen2ForCausalLM(cfg)
            finally:
                torch.set_default_dtype(torch.float32)
    if mode in LORA_MODES:
        import peft

        if mode == "tsd_qlora" and not a.load_model:
            import trainstream

            trainstream.quantize_model(model, "nf4", block_size=64)
        elif mode == "bnb_qlora":
            bnb_quantize(model)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if a.grad_ckpt:
        model.gradient_checkpointing_enable()
        if mode in LORA_MODES:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input with grad
    return model, cfg.vocab_size


def loaded_model(cfg: Any, mode: str, socket: Optional[str]) -> Any:
    """--load-model: the base as users load it, `load_model(dir, random_weights=True)`
    on a folder holding only `cfg` (tsd_qlora: quantize="nf4", block 64; tsd_lora: bf16), in host
    memory (quantized weights in the memory of the tsd at `socket`, load_model's default)."""
    import torch
    from trainstream.integrations.huggingface import load_model

    if socket:
        os.environ["TSD_SOCKET"] = socket  # load_model(host="auto") asks the default socket
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        model = load_model(d, quantize="nf4" if mode == "tsd_qlora" else "none", dtype=torch.bfloat16,
                           random_weights=True, block_size=64, progress=False)
    print(f"load_model: {model._ts_load_info}", file=sys.stderr)
    model.train()
    return model


def host_built(a: argparse.Namespace, mode: str) -> bool:
    """Whether `mode` gets its model on the host: a tsd mode paging its weights (--param-offload)."""
    return bool(a.param_offload) and mode in TSD_MODES and a.device == "cuda"


def host_model(cfg: Any, dtype: Any, device: str) -> Any:
    """A Qwen2 model of `cfg` in host memory, initialised as transformers does (normal(0, 0.02)
    weights, zero biases, unit norms) but with each tensor drawn on `device` and copied over: torch
    draws normal values on the CPU in one thread, minutes for a 14B model. At most one tensor is
    on the GPU at a time (the embedding, under 2 GiB), before any cap is set."""
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.initialization import no_init_weights

    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=g))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return model


def bnb_quantize(model: Any) -> None:
    """Replaces every nn.Linear of the decoder layers with bitsandbytes' Linear4bit holding the
    same weight in NF4 (block 64, no double quantization, bf16 compute): what transformers does
    for BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.bfloat16), here on random weights already on the GPU."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4",
                                      device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=False,
                                             quant_type="nf4", blocksize=64)
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q.to(child.weight.device))  # quantizes on the GPU
                del child
    model.is_loaded_in_4bit = True  # peft picks its bitsandbytes LoRA layer by this flag
    torch.cuda.empty_cache()


def run_tsd_mode(a: argparse.Namespace) -> None:
    """One tsd mode, or a peer this script runs itself (bnb_qlora), in this process; prints
    @@{json} like peers.py does."""
    import torch

    cuda = a.device == "cuda"
    history = os.environ.get("TSD_BENCH_MEMORY_HISTORY")  # a folder: the allocator's history, dumped on failure
    if cuda and history:
        # Python frames only, and a bounded history: the snapshot of a 14B run with C++ frames was
        # too large to bring back from the GPU machine.
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        _run_mode(a, cuda)
    except BaseException:
        # Where it failed and what tsd's planner had decided by then, then (with a history) what
        # held the device's memory: the parent prints the end of this output.
        print(f"{a.mode} failed at step {_PROGRESS['step']} ({_PROGRESS['phase']}); the session's events:",
              file=sys.stderr)
        for e in list(getattr(_PROGRESS["session"], "events", []) or [])[-30:]:
            print(f"  {e}", file=sys.stderr)
        if cuda and history:
            import memory_summary

            os.makedirs(history, exist_ok=True)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(os.path.join(history, f"{a.mode.replace(':', '_')}-failed.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
            print(memory_summary.summarize(snapshot, top=30, trace=25, depth=3), file=sys.stderr)
        sys.stderr.flush()
        raise


# Where the running mode is (step, phase, its session), for the report of a failure.
_PROGRESS: dict[str, Any] = {"step": 0, "phase": "setup", "session": None}


def _run_mode(a: argparse.Namespace, cuda: bool) -> None:
    import torch

    if a.cap_gib:
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    t0 = time.time()
    lora = a.mode in LORA_MODES
    model, vocab = build_model(a, a.mode)
    n_params = sum(p.numel() for p in model.parameters())  # before wrap(): paged weights leave placeholders
    if not host_built(a, a.mode):
        model = model.to(a.device)
    param_dtype = torch.bfloat16 if a.mode.startswith("tsd_bf16") else None
    moment_dtype = "bfloat16" if a.mode.startswith("tsd_bf16m") else a.moment_dtype
    activation_offload = option_value(a.activation_offload) if a.mode.endswith("_act") else False
    param_offload = option_value(a.param_offload) if a.param_offload else False
    stock_opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4 if lora else 1e-5)
    autocast = cuda and not lora
    session = None
    # The trainer's host memory before wrap() (the model built, CUDA up): the base that
    # check_memory's host_bytes (tsd's regions and the client's own needs) is added to.
    host_before_wrap = benchlib.pss_bytes(os.getpid())
    if a.mode in TSD_MODES:
        import trainstream

        model, opt = trainstream.wrap(model, stock_opt, device=a.device, socket=a.socket,
                                      offload=option_value(a.offload),
                                      moment_dtype=moment_dtype, param_dtype=param_dtype,
                                      activation_offload=activation_offload, param_offload=param_offload,
                                      max_grad_norm=a.clip or None, overlap_forward=a.overlap == "on",
                                      optimizer_gpu_fraction=option_value(a.gpu_fraction))
        session = trainstream.unwrap_session(model)
        _PROGRESS["session"] = session
        clip = None
    else:  # a peer: torch's AdamW on the GPU, clipping as Hugging Face's Trainer does
        opt = stock_opt
        trained = [p for p in model.parameters() if p.requires_grad]
        clip = (lambda: torch.nn.utils.clip_grad_norm_(trained, a.clip)) if a.clip else None
    setup_s = time.time() - t0
    ids = torch.randint(0, vocab, (a.batch, a.seq), device=a.device)
    loader = iter(random_token_loader(a, vocab)) if a.loader_workers else None
    data_ms: list[float] = []
    act_pager = getattr(session, "act_pager", None)
    act_paged: list[int] = []  # the activation pager's cumulative bytes, before each step
    times, fwd_ms, bwd_ms, step_ms = [], [], [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    retries: list[int] = []  # the caching allocator's retries in each step
    retries_seen = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        retries_seen = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for step in range(a.steps):
        _PROGRESS.update(step=step + 1, phase="forward")
        sync()
        prof = start_profile(cuda) if step + 1 == a.profile_step else None
        t = time.perf_counter()
        act_paged.append(int(getattr(act_pager, "paged_bytes", 0) or 0))
        if loader is not None:  # the next batch from the workers (the wait counts in the step)
            ids = next(loader).to(a.device, non_blocking=True)
            data_ms.append((time.perf_counter() - t) * 1e3)
        if cuda:
            ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        if cuda:
            ev[1].record()
        tb = time.perf_counter()
        _PROGRESS["phase"] = "backward"
        loss.backward()
        if cuda:
            ev[2].record()
        ts = time.perf_counter()
        _PROGRESS["phase"] = "optimizer step"
        if clip is not None:
            clip()
        opt.step()
        step_ms.append((time.perf_counter() - ts) * 1e3)
        opt.zero_grad(set_to_none=True)
        sync()
        if cuda:
            now = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            retries.append(now - retries_seen)
            retries_seen = now
        if prof is not None:  # the profiled step is left out of the figures: the profiler slows it
            end_profile(prof, a.entry or a.mode)  # the --modes entry: MODE and MODE:uncapped apart
            continue
        times.append(time.perf_counter() - t)
        if cuda:
            fwd_ms.append(ev[0].elapsed_time(ev[1]))
            bwd_ms.append(ev[1].elapsed_time(ev[2]))
        else:  # wall time: the CPU runs forward and backward synchronously
            fwd_ms.append((tb - t) * 1e3)
            bwd_ms.append((ts - tb) * 1e3)

    def med(xs: list[float]) -> float:  # steps 3+, the middle (upper for an even count) as peers.py takes it
        tail = xs[2:] or xs
        return sorted(tail)[len(tail) // 2]

    held = 0
    if session is not None:
        import trainstream

        with trainstream.connect(socket=a.socket) as c:
            job = getattr(getattr(session, "client", None), "job", None)
            held = sum(j.used_bytes for j in c.jobs() if job is None or j.name == job)
    pager = getattr(session, "pager", None)
    handle = getattr(session, "handle", None)
    host: dict[str, Any] = {}
    if session is not None:
        trained = [p for p in model.parameters() if p.requires_grad]
        moments = str(getattr(opt, "moment_dtype", moment_dtype))
        per = stream.host_bytes_per_param(trained[0].element_size() if trained else 4,
                                          trained[0].element_size() if trained else 4,
                                          2 if moments == "bfloat16" else 4, bool(a.clip))
        n_trained = sum(p.numel() for p in trained)
        act_paged.append(int(getattr(act_pager, "paged_bytes", 0) or 0))
        act_steps = [b - a_ for a_, b in zip(act_paged, act_paged[1:]) if b >= a_]
        paging = 2 * med([float(x) for x in act_steps]) if act_steps else 0.0  # out and back
        paging += pager.moved_bytes / a.steps if pager is not None else 0.0
        host = dict(host_bytes_per_param=per["total"], host_bytes_breakdown=per, trained_params=n_trained,
                    paging_host_bytes_per_step=paging, host_bytes_per_step=n_trained * per["total"] + paging)
    events = list(getattr(session, "events", []) or [])
    mplan = getattr(session, "memory_plan", None)
    if mplan is not None and host_before_wrap is not None:
        host.update(host_pss_before_wrap_gib=host_before_wrap / 2**30,
                    # wrap()'s host bytes and the activation pages checked after the first step
                    check_memory_host_gib=(mplan.host_bytes + int(getattr(session, "activation_host_bytes", 0))) / 2**30,
                    check_memory_room_gib=(mplan.host_room / 2**30 if mplan.host_room is not None else None))
    record = dict(
        mode=a.mode, arch=a.arch, params=n_params, batch=a.batch, seq=a.seq,
        clip=a.clip, step_s_median=med(times), steps=times,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, tsd_gib=held / 2**30,
        setup_s=setup_s, loss=loss.item(), moments=str(getattr(opt, "moment_dtype", moment_dtype)),
        param_dtype=str(param_dtype), activation_offload=activation_offload,
        paged_gib_per_step=(pager.moved_bytes / a.steps / 2**30 if pager is not None else 0.0),
        paged_blocks=(len(pager.paged) if pager is not None else 0),
        blocks=(len(pager.blocks) if pager is not None else None), param_offload=param_offload,
        reserved_peak_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        # Times the caching allocator hit the cap, freed its cache (cudaFree: a device sync) and
        # retried, over the timed steps: a run planned close to its cap pays for each.
        alloc_retries=sum(retries) if cuda else None,
        alloc_retries_per_step=retries if cuda else None,
        plan=[e for e in events if "plan" in e or "offload" in e or "activation" in e or "gpu_fraction" in e][-6:],
        offload_final=str(getattr(session, "offload", None)),
        gpu_forward_ms=med(fwd_ms), gpu_backward_ms=med(bwd_ms), step_call_ms=med(step_ms),
        isa=getattr(handle, "isa", None), threads=getattr(handle, "threads", None), grad_ckpt=a.grad_ckpt,
        loader_workers=a.loader_workers, data_wait_ms=med(data_ms) if data_ms else None, **host)
    if session is not None and a.save_restore:
        _PROGRESS["phase"] = "save and restore"
        try:  # a failure here is recorded beside the steps' figures, as unwrap()'s is
            import save_restore

            batches = save_restore.fixed_batches(vocab, a.batch, a.seq, a.device)
            record.update(save_restore.check(model, opt, batches, autocast))
        except Exception:
            import traceback

            traceback.print_exc()
            record["resume_exact"] = 0
            record["save_restore_failed"] = 1
    if session is not None:
        # unwrap() is part of the run (a model handed back must fit where it goes back); a failure
        # there is reported beside the steps' figures instead of discarding them.
        import traceback

        import trainstream

        _PROGRESS["phase"] = "unwrap"
        t_unwrap = time.time()
        try:
            trainstream.unwrap(model)
            record["unwrap_s"] = time.time() - t_unwrap
            record["unwrap_failed"] = 0
        except Exception:
            traceback.print_exc()
            record["unwrap_failed"] = 1
        record["unwrap_device"] = str(next(model.parameters()).device)
    print("@@" + json.dumps(record), flush=True)


def start_profile(cuda: bool) -> Any:
    """A started torch profiler (CPU, and CUDA on a GPU) for `--profile-step`."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=True)  # Python calls in the trace
    prof.start()
    return prof


def end_profile(prof: Any, mode: str) -> None:
    """Stops `prof` and writes, into $TSD_BENCH_PROFILE_DIR (default: the temporary folder), the
    operations by CPU time and by device time (profile-MODE.txt, also printed to stderr) and a
    gzipped Chrome trace (profile-MODE.json.gz)."""
    import torch

    prof.stop()
    folder = os.environ.get("TSD_BENCH_PROFILE_DIR") or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"profile-{mode.replace(':', '_')}")
    prof.export_chrome_trace(base + ".json.gz")
    table = prof.key_averages()
    text = f"--profile-step: {mode}; by CPU time:\n" + table.table(sort_by="self_cpu_time_total", row_limit=30)
    if torch.cuda.is_available():
        text += "\nby device time:\n" + table.table(sort_by="self_device_time_total", row_limit=20)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(text, file=sys.stderr, flush=True)


class RandomTokens:
    """An endless stream of random token batches (what the benchmark trains on), made in a
    DataLoader's worker processes: each worker draws from its own seed."""

    def __init__(self, vocab: int, batch: int, seq: int) -> None:
        self.vocab, self.batch, self.seq = vocab, batch, seq

    def __iter__(self) -> Any:
        import torch

        g = torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        while True:
            yield torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)


def random_token_loader(a: argparse.Namespace, vocab: int) -> Any:
    """--loader-workers: a torch DataLoader of `a.loader_workers` worker processes (pinned batches
    on a GPU run), as a trainer's input pipeline would be."""
    import torch.utils.data as tud

    class RandomTokenDataset(RandomTokens, tud.IterableDataset):  # type: ignore[misc]
        pass

    dataset = RandomTokenDataset(vocab, a.batch, a.seq)
    return tud.DataLoader(dataset, batch_size=None, num_workers=a.loader_workers, pin_memory=a.device == "cuda",
                          persistent_workers=True, prefetch_factor=2)


def measure_stream(a: argparse.Namespace, rec: benchlib.Recorder) -> Optional[dict[str, Any]]:
    """STREAM in this run (bench/stream_bench, non-temporal stores): recorded as mode "stream",
    returned for the bounds; None (recorded as skipped) without the binary or when it fails."""
    binary = stream.find_binary(a.stream_bin, a.tsd_bin or os.environ.get("TSD_BIN"), ROOT)
    work = {"device": "host", "kernels": "copy,scale,add,triad; ordinary and non-temporal stores"}
    if binary is None:
        rec.record("stream", work, {}, status="skipped", reason="no stream_bench: build it (ninja stream_bench) "
                   "or pass --stream-bin")
        return None
    try:
        got = stream.measure(binary, array_mib=a.stream_mib)
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
        rec.record("stream", work, {}, status="failed", reason=str(e)[-1500:])
        return None
    values = {k: v for k, v in got.items() if k.endswith("_gbs")}
    values["bandwidth_gbs"] = stream.bandwidth_gbs(got)
    rec.record("stream", {**work, "threads": got.get("threads"), "array_mib": got.get("array_mib")}, values,
               extra={"raw": got})
    print("@@" + json.dumps({"mode": "stream", **values}), flush=True)
    return values


def bound_lines(records: list[dict[str, Any]], measured: dict[str, Any]) -> list[str]:
    """Each tsd mode's bound in this run: max(the GPU's forward + backward, its host bytes per step
    / the STREAM bandwidth), beside its measured step (medians over the run's repeats). The GPU part
    is stock's forward + backward when its records carry them, else the mode's own (CUDA events)."""
    def median(xs: list[float]) -> Optional[float]:
        return sorted(xs)[len(xs) // 2] if xs else None

    def fwd_bwd(vals: list[dict[str, Any]]) -> Optional[float]:
        return median([(v["gpu_forward_ms"] + v["gpu_backward_ms"]) / 1e3 for v in vals
                       if "gpu_forward_ms" in v and "gpu_backward_ms" in v])

    ok = [r for r in records if r.get("status") == "ok"]
    stock_fb = fwd_bwd([r["values"] for r in ok if r["mode"] == "stock"])
    bw = float(measured["bandwidth_gbs"])
    out = [f"bound = max(GPU forward+backward ({'stock: %.3f s' % stock_fb if stock_fb else 'the mode own'}), "
           f"host bytes per step / STREAM {bw:.1f} GB/s)"]
    for mode in dict.fromkeys(r["mode"] for r in ok if base_mode(r["mode"]) in TSD_MODES):
        vals = [r["values"] for r in ok if r["mode"] == mode and "host_bytes_per_step" in r["values"]]
        if not vals:
            continue
        host_bytes = median([v["host_bytes_per_step"] for v in vals]) or 0.0
        fb = stock_fb if stock_fb else (fwd_bwd(vals) or 0.0)
        bound = stream.bound_s(fb, host_bytes, bw)
        step = median([v["step_s_median"] for v in vals])
        out.append(f"  {mode}: {vals[0]['host_bytes_per_param']} B/param, host {host_bytes / (bw * 1e9):.3f} s, "
                   f"GPU {fb:.3f} s, bound {bound:.3f} s"
                   + (f", step {step:.3f} s ({step / bound:.2f}x the bound)" if step and bound else ""))
    return out


def run_capped() -> None:
    """Internal: `--run-capped GIB SCRIPT ARGS...` runs SCRIPT as __main__ under a VRAM cap (for
    offload_peers.py, which has no --cap-gib of its own)."""
    import torch

    cap, script, rest = float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


def base_mode(mode: str) -> str:
    """The mode of a --modes entry, without its variants (see `mode_settings`)."""
    return mode.split(":")[0]


# MODE:alloc=NAME: the child runs with PYTORCH_CUDA_ALLOC_CONF set so (torch's caching allocator:
# expandable segments grow one mapping instead of caching fixed segments, which fragment near a cap).
ALLOC_CONFS = {"expandable": "expandable_segments:True"}


def mode_settings(mode: str, a: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The mode of a --modes entry and the settings it runs with: MODE, then any of :uncapped
    (no --cap-gib), :overlap=on|off (--overlap), :gpu=F|auto (--gpu-fraction), :alloc=expandable
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the child's environment), e.g.
    tsd_bf16_act:overlap=off beside tsd_bf16_act in one run. Raises ValueError for anything else."""
    name, *variants = mode.split(":")
    over: dict[str, Any] = {}
    for v in variants:
        key, eq, value = v.partition("=")
        if key == "uncapped" and not eq:
            over["cap_gib"] = 0
        elif key == "overlap" and value in ("on", "off"):
            over["overlap"] = value
        elif key == "gpu" and eq:
            option_value(value)  # a number or auto
            over["gpu_fraction"] = value
        elif key == "alloc" and value in ALLOC_CONFS:
            over["alloc_conf"] = ALLOC_CONFS[value]
        else:
            raise ValueError(f"mode {mode!r}: unknown variant {v!r} (uncapped, overlap=on|off, gpu=F|auto, "
                             f"alloc={'|'.join(ALLOC_CONFS)})")
    return name, argparse.Namespace(**{**vars(a), **over})


def option_value(text: Any) -> Any:
    """A wrap() option given on the command line: auto, true/false, a fraction."""
    if not isinstance(text, str):
        return text
    low = text.lower()
    if low in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[low]
    return float(text)


def child_argv(mode: str, a: argparse.Namespace) -> list[str]:
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
    return [sys.executable, os.path.abspath(__file__), "--mode", mode, "--socket", a.socket or "", "--device", a.device,
            *(["--grad-ckpt"] if a.grad_ckpt else []),
            "--moment-dtype", a.moment_dtype, "--activation-offload", str(a.activation_offload),
            "--clip", str(a.clip), "--overlap", a.overlap, *common, *(["--peers", a.peers] if a.peers else []),
            *(["--param-offload", a.param_offload] if a.param_offload else []), "--offload", a.offload,
            *(["--load-model"] if a.load_model else []), *(["--save-restore"] if a.save_restore else []),
            *(["--profile-step", str(a.profile_step), "--entry", entry] if a.profile_step else []),
            *(["--cap-gib", str(a.cap_gib)] if a.cap_gib else []), "--gpu-fraction", a.gpu_fraction,
            *(["--loader-workers", str(a.loader_workers)] if a.loader_workers else [])]


def workload(mode: str, a: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    mode, a = mode_settings(mode, a)
    w: dict[str, Any] = {"arch": a.arch, "params": raw.get("params"), "batch": a.batch, "seq": a.seq, "steps": a.steps,
                         "device": a.device, "dtype": DTYPES.get(mode, "") if a.device == "cuda" else "fp32",
                         "clip": a.clip, "vram_cap_gib": a.cap_gib, **({"grad_ckpt": True} if a.grad_ckpt else {}),
                         **({"alloc_conf": a.alloc_conf} if getattr(a, "alloc_conf", None) else {})}
    if mode in TSD_MODES:
        w.update(moment_dtype=raw.get("moments", a.moment_dtype), param_dtype=raw.get("param_dtype"),
                 activation_offload=raw.get("activation_offload"), tsd_isa=raw.get("isa"),
                 tsd_threads=raw.get("threads"), daemon_args=a.daemon_args, overlap_forward=a.overlap,
                 **({"param_offload": raw.get("param_offload")} if a.param_offload else {}),
                 **({"offload": a.offload} if a.offload != "true" else {}),
                 **({"load_model": True} if a.load_model and mode in ("tsd_lora", "tsd_qlora") else {}),
                 **({"optimizer_gpu_fraction": a.gpu_fraction} if a.gpu_fraction not in ("0", "0.0") else {}),
                 **({"loader_workers": a.loader_workers} if a.loader_workers else {}))
    return w


VALUE_KEYS = {"step_s_median": "step_s_median", "steps": "step_s", "peak_gib": "vram_torch_peak_gib",
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
              "check_memory_room_gib": "check_memory_room_gib"}


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


def start_daemon(a: argparse.Namespace) -> subprocess.Popen[bytes]:
    import trainstream

    binary = a.tsd_bin or os.environ.get("TSD_BIN") or os.path.join(ROOT, "build", "bin", "tsd")
    if not os.path.exists(binary):
        sys.exit(f"finetune_bench: no tsd at {binary}: build it (scripts/build.sh) or pass --tsd-bin/--socket")
    a.socket = os.path.join(tempfile.mkdtemp(prefix="tsd-bench-"), "tsd.sock")
    daemon = subprocess.Popen([binary, "--socket", a.socket, "--pool-size", a.pool_size, "--metrics-listen", "",
                               *a.daemon_args.split()], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            trainstream.connect(socket=a.socket).close()
            return daemon
        except trainstream.DaemonUnavailable:
            if daemon.poll() is not None:
                break
            time.sleep(0.1)
    daemon.kill()
    sys.exit(f"finetune_bench: tsd did not start (exit status {daemon.poll()}); run {binary} --help")


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
        option_value(a.activation_offload), option_value(a.param_offload or "false")
        if option_value(a.offload) not in (True, "auto"):
            raise ValueError("--offload")
    except ValueError:
        ap.error("--activation-offload and --param-offload take auto, true, false or a number; --offload true or auto")
    a.modes_list, a.once_set = modes, frozenset(once)
    return a


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
    skips = {m: skip_reason(base_mode(m), a) for m in a.modes_list}
    nvml = benchlib.Nvml.open() if a.device == "cuda" else None
    gpu = benchlib.Nvml.index_for_visible()
    daemon = client = None
    try:
        if any(base_mode(m) in TSD_MODES and skips[m] is None for m in a.modes_list):
            import trainstream

            if a.socket is None:
                daemon = start_daemon(a)
            client = trainstream.connect(socket=a.socket)
        daemon_pid = client.status().pid if client is not None else None
        # What tsd lends before any mode runs (other jobs, with --socket): the level a mode's job leaves it at.
        idle_used = client.status().used_bytes if client is not None else 0
        want_stream = a.stream == "on" or (a.stream == "auto" and a.device == "cuda")
        measured_stream = measure_stream(a, rec) if client is not None and want_stream else None
        for repeat, mode in schedule(a.modes_list, a.repeats, a.once_set):
            if skips[mode] is not None:
                if repeat == 0:
                    rec.record(mode, workload(mode, a, {}), {}, status="skipped", reason=skips[mode], repeat=repeat)
                    print(f"@@{json.dumps({'mode': mode, 'skipped': skips[mode]})}", flush=True)
                continue
            tsd = base_mode(mode) in TSD_MODES
            if client is not None:  # tsd frees a finished (or failed) child's job after it goes: wait for that
                deadline = time.time() + 120
                while client.status().used_bytes > idle_used and time.time() < deadline:
                    time.sleep(0.5)
            tsd_pss_before = benchlib.pss_bytes(daemon_pid) if tsd and daemon_pid else None
            conf = getattr(mode_settings(mode, a)[1], "alloc_conf", None)
            run = benchlib.run_sampled(child_argv(mode, a), a.sample_interval, daemon_pid if tsd else None,
                                       (lambda: client.status().used_bytes) if tsd and client else None, nvml, gpu,
                                       env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf) if conf else None)
            status, reason, values, raw = outcome(run, tsd_pss_before)
            if status == "failed":  # the whole traceback, for the log of the run
                print(f"{mode} failed; the end of its output:\n" + "\n".join(
                    (run.stderr or run.stdout).strip().splitlines()[-150:]), file=sys.stderr, flush=True)
            rec.record(mode, workload(mode, a, raw), values, status=status, reason=reason, repeat=repeat,
                       extra={"raw": raw} if raw else None)
            print("@@" + json.dumps({"mode": mode, "repeat": repeat, "status": status, **(
                {"reason": reason[-300:]} if reason else {}), **values}), flush=True)
    finally:
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    records = [r for r in benchlib.read_results(rec.path) if r["run_id"] == rec.run_id]
    peers = ("fsdp2_offload", "ds_offload", "torchao_offload", "stock", "lora_stock", "bnb_qlora", "lora_torch")
    ratios = [f"step:{m}" for m in peers if m in a.modes_list]
    ratios += [f"vram:{m}" for m in ("stock", "lora_stock", "bnb_qlora", "lora_torch") if m in a.modes_list]
    block = report.Block("run", "modes", {"benchmark": ["finetune"], "run": [rec.run_id], "modes": [",".join(
        a.modes_list)], "cols": ["step,vram,vram_device,host,host_bound,tsd,rss,fwd,bwd,wait"], "ratio": ratios}, 0)
    print(f"\n{a.arch}, batch {a.batch}x{a.seq}, clip {a.clip:g}, {a.steps} steps (median of steps 3+), "
          f"{a.repeats} round(s); recorded in {os.path.relpath(rec.path)}\n")
    print(report.render_modes(block, records))
    if measured_stream:
        for line in bound_lines(records, measured_stream):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
