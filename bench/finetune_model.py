"""The models `finetune_bench.py`'s modes train: the Qwen architectures of peers.py (or the tiny
CPU model) with random weights, built on the GPU or, for weight paging, on the host; loaded
through tsd's `load_model` or quantized with bitsandbytes for the QLoRA modes."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from typing import Any, Optional

from finetune_modes import LORA_MODES, TINY, TSD_MODES

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
        model = drawn_model(cfg, torch.bfloat16 if bf16 else torch.float32, "cpu", a.device)
    elif mode not in LORA_MODES and mode in TSD_MODES and a.device == "cuda":
        # fp32 on the GPU as a checkpoint loaded in fp32 and moved there is, drawn there: torch
        # draws the CPU's normal values in one thread, 43 s of each 1.5B run's setup on the GPU
        # machine. The peers (peers.py) still draw theirs on the CPU; the values differ, the
        # distribution and hence the step's work do not.
        model = drawn_model(cfg, torch.float32, a.device, a.device)
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


def drawn_model(cfg: Any, dtype: Any, home: str, device: str) -> Any:
    """A Qwen2 model of `cfg` built on `home` (the host, for weight paging, or the GPU), initialised
    as transformers does (normal(0, 0.02) weights, zero biases, unit norms) but with each tensor
    drawn on `device` and copied over: torch draws normal values on the CPU in one thread, minutes
    for a 14B model. Built on the host, at most one tensor is on the GPU at a time (the embedding,
    under 2 GiB), before any cap is set."""
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.initialization import no_init_weights

    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), torch.device(home):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    # no_init_weights also skips tying the head to the embedding (tie_word_embeddings, Qwen2.5-1.5B's):
    # untied, the model had 233M more parameters than the peers' (15% more optimizer work and bytes).
    model.tie_weights()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.device.type == device:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=g))
    if device == "cuda":
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
