"""The modes of `finetune_bench.py` and the settings of a --modes entry: which modes exist, what
each needs and keeps in which precision, the interleaved order of a run's rounds, why a mode
cannot run here, and the variants an entry may carry (MODE:uncapped, :cap=G, :clip=X,
:overlap=on|off, :gpu=F|auto, :alloc=expandable, :threads=N, :ckpt, :recompute=V)."""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Optional

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


def schedule(modes: list[str], repeats: int, once: frozenset[str] = frozenset(),
             first: int = 0) -> list[tuple[int, str]]:
    """The order of the runs: every mode in every round, interleaved (A B C A B C ...); the modes
    in `once` only in the first round. Rounds are numbered from `first` (a continued run's rounds
    follow its earlier ones, which had the first round)."""
    return [(r, m) for r in range(first, first + repeats) for m in modes if r == 0 or m not in once]


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


def base_mode(mode: str) -> str:
    """The mode of a --modes entry, without its variants (see `mode_settings`)."""
    return mode.split(":")[0]


# MODE:alloc=NAME: the child runs with PYTORCH_CUDA_ALLOC_CONF set so (torch's caching allocator:
# expandable segments grow one mapping instead of caching fixed segments, which fragment near a cap).
ALLOC_CONFS = {"expandable": "expandable_segments:True"}


def mode_settings(mode: str, a: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """The mode of a --modes entry and the settings it runs with: MODE, then any of :uncapped
    (no --cap-gib), :cap=G (--cap-gib G: a budget sweep in one run), :clip=X (--clip X),
    :overlap=on|off (--overlap), :gpu=F|auto (--gpu-fraction), :alloc=expandable
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the child's environment), :threads=N (a
    tsd of its own started with --optimizer-threads N; the setting is `daemon_threads`), :ckpt
    (the model's gradient checkpointing, --grad-ckpt, for this entry: modes this script runs),
    :recompute=auto|true|F (--activation-recompute, *_act modes), e.g.
    tsd_bf16_act:overlap=off beside tsd_bf16_act in one run. Raises ValueError for anything else."""
    name, *variants = mode.split(":")
    over: dict[str, Any] = {}
    for v in variants:
        key, eq, value = v.partition("=")
        if key == "uncapped" and not eq:
            over["cap_gib"] = 0
        elif key in ("cap", "clip") and eq:
            number = _number(mode, v, value)
            if key == "cap" and number <= 0:
                raise ValueError(f"mode {mode!r}: cap={value} is not a VRAM budget in GiB (a number > 0; "
                                 f":uncapped runs without one)")
            over["cap_gib" if key == "cap" else "clip"] = number
        elif key == "overlap" and value in ("on", "off"):
            over["overlap"] = value
        elif key == "gpu" and eq:
            option_value(value)  # a number or auto
            over["gpu_fraction"] = value
        elif key == "alloc" and value in ALLOC_CONFS:
            over["alloc_conf"] = ALLOC_CONFS[value]
        elif key == "threads" and eq:
            if name not in TSD_MODES:
                raise ValueError(f"mode {mode!r}: threads={value} sets tsd's optimizer threads; {name} does not use tsd")
            if not value.isdigit() or not 1 <= int(value) <= 4096:
                raise ValueError(f"mode {mode!r}: threads={value} is not a thread count (an integer in 1..4096)")
            over["daemon_threads"] = int(value)
        elif key == "recompute" and eq:
            if not name.endswith("_act"):
                raise ValueError(f"mode {mode!r}: recompute={value} sets activation_recompute, which the *_act modes "
                                 f"pass (beside activation_offload); {name} is not one")
            option_value(value)  # auto, true, false or a fraction
            over["activation_recompute"] = value
        elif key == "ckpt" and not eq:
            if name in PEER_MODES or name in OFFLOAD_MODES:
                raise ValueError(f"mode {mode!r}: ckpt turns on gradient checkpointing in the modes this script runs "
                                 f"itself; {name} runs in the peers' script, which has no such option")
            over["grad_ckpt"] = True
        else:
            raise ValueError(f"mode {mode!r}: unknown variant {v!r} (uncapped, cap=G, clip=X, overlap=on|off, gpu=F|auto, "
                             f"alloc={'|'.join(ALLOC_CONFS)}, threads=N, ckpt, recompute=auto|true|F)")
    return name, argparse.Namespace(**{**vars(a), **over})


def _number(mode: str, variant: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"mode {mode!r}: {variant!r} needs a number") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"mode {mode!r}: {variant!r} needs a finite number >= 0")
    return number


def option_value(text: Any) -> Any:
    """A wrap() option given on the command line: auto, true/false, a fraction."""
    if not isinstance(text, str):
        return text
    low = text.lower()
    if low in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[low]
    return float(text)
