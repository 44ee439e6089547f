"""LoRA on a large causal LM (the Qwen2.5 7B, 14B and 32B architectures, or any local checkpoint)
through TrainStreamTrainer: the base is loaded by trainstream's loader (quantized while it is read
when asked), frozen, and only the adapters' AdamW runs in tsd. With --compare the stock Trainer
with peft trains the same base and adapters on the same batches first, and the two are printed
side by side (losses, median step time, peak memory).

    python examples/lora_large_model.py [--model tiny|qwen7b|qwen14b|qwen32b|DIR] [--random-weights]
        [--quantize auto|none|int8|nf4] [--prefer exact|speed] [--steps 6] [--compare]
        [--device auto|cuda|cpu] [--layers N] [--batch 2] [--seq 64] [--rank 8] [--socket PATH]

--model names an architecture (its config is written here; no download) or a directory with
config.json and .safetensors files. The named architectures have no weights here: pass
--random-weights (the default for `tiny`, a 2-layer Qwen2 that runs on the CPU in seconds).
--layers N keeps the first N decoder layers (a smaller model of the same width).
--quantize: "none", "int8" or "nf4" quantize the frozen linear weights of the decoder layers while
they are read (trainstream.integrations.huggingface.load_model); "auto" (the default) loads them
unquantized when the host memory holds them, and lets wrap() quantize them only when they would not
fit in the GPU's usable VRAM: int8 first, or NF4 first with --prefer speed (wrap's `prefer=`).
On the CPU "auto" quantizes nothing.

Checks, printed as PASS/FAIL: only the adapters are trained in tsd (the base stays frozen and
unchanged), every loss is finite, the adapters changed; with --compare, the losses equal the stock
run's (within 2e-4 in fp32 on the CPU, 2e-2 in bf16 on CUDA). tsd must be running
(scripts/run-main.sh starts one). Exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch

import trainstream
from trainstream.units import format_bytes

# The Qwen2.5 base models' architectures (their config.json fields), so that no download is needed.
ARCHS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                    num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                    num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-5, tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Tokens(torch.utils.data.Dataset):
    """A few random token sequences (the labels are the inputs): the adapters can learn them."""

    def __init__(self, vocab: int, n: int, seq: int) -> None:
        self.ids = torch.randint(0, min(vocab, 32000), (n, seq), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model_dir(args: argparse.Namespace, scratch: str) -> str:
    """The checkpoint directory: the one given, or a config.json of a named architecture."""
    if args.model in ARCHS:
        from transformers import Qwen2Config
        Qwen2Config(**ARCHS[args.model]).save_pretrained(scratch)
        return scratch
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r} is neither one of {sorted(ARCHS)} nor a directory with a "
                         f"config.json")
    return args.model


def load(args: argparse.Namespace, path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The base (frozen, quantized as asked) with LoRA adapters on every linear of its layers."""
    import peft
    from trainstream.integrations.huggingface import load_model
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    # "auto": unquantized when the host holds it (wrap() then decides against the VRAM).
    base = load_model(path, quantize=args.quantize, dtype=dtype, random_weights=args.random_weights, **overrides)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS,
                          task_type="CAUSAL_LM")
    return peft.get_peft_model(base, cfg)


class StepTimer:
    """Seconds per optimizer step (a Trainer callback)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                outer.start = time.perf_counter()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                outer.times.append(time.perf_counter() - outer.start)

        self.callback = _CB()
        self.times: list[float] = []
        self.start = 0.0


def checksum(p: torch.Tensor) -> float:
    """A weight's sum in float64 on the CPU: the same values give the same sum wherever the weight
    is (a sum on the GPU adds in another order, so it is not compared with one on the CPU)."""
    return float(p.detach().cpu().double().sum().item())


def run(kind: str, args: argparse.Namespace, path: str, device: str, out: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments
    from trainstream.integrations.huggingface import TrainStreamTrainer
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load(args, path, dtype)
    base_before = {n: checksum(p) for n, p in model.named_parameters() if "lora_" not in n and p.dtype.is_floating_point}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    targs = TrainingArguments(output_dir=out, use_cpu=device == "cpu", per_device_train_batch_size=args.batch,
                              max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant",
                              logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                              max_grad_norm=1.0, bf16=device == "cuda", log_level="error")
    data = Tokens(model.config.vocab_size, 4 * args.batch, args.seq)
    timer = StepTimer()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if kind == "stock":
        trainer: Any = Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer.callback])
    else:
        trainer = TrainStreamTrainer(model=model, args=targs, train_dataset=data, callbacks=[timer.callback],
                                     trainstream={"socket": args.socket, "prefer": args.prefer,
                                                  "quantize": "auto" if args.quantize == "auto" else None})
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)
    result: dict[str, Any] = {}
    try:
        trainer.train()
        if kind == "tsd":
            s = trainer.trainstream_session
            names = {id(p): n for n, p in model.named_parameters()}
            result["in_tsd"] = [names.get(id(ps.param), "?") for ps in s.params]
            result["events"] = list(s.events)
    finally:
        if kind == "tsd" and trainstream.unwrap_session(model) is not None:
            trainstream.unwrap(model)
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["step_s"] = statistics.median(timer.times[1:] or timer.times) if timer.times else float("nan")
    result["peak"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    params = dict(model.named_parameters())
    result["base_unchanged"] = all(checksum(params[n]) == v for n, v in base_before.items() if n in params)
    result["adapters_changed"] = any(not torch.equal(params[n].detach().cpu(), v.cpu()) for n, v in lora_before.items()
                                     if n in params)
    result["quantized"] = getattr(model.get_base_model(), "_ts_load_info", {}).get("quantize")
    del trainer, model, params
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def check(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help=f"{', '.join(ARCHS)} or a checkpoint directory (default tiny)")
    ap.add_argument("--random-weights", action="store_true", help="build the architecture with random weights "
                                                                   "(no checkpoint read; implied for tiny)")
    ap.add_argument("--quantize", choices=("auto", "none", "int8", "nf4"), default="auto")
    ap.add_argument("--prefer", choices=("exact", "speed"), default="exact",
                    help="with --quantize auto: int8 first (exact) or NF4 first (speed) when the base must shrink")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compare", action="store_true", help="run the stock Trainer with peft first and compare")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--socket", default=None, help="tsd's socket (default $TSD_SOCKET, then tsd's default path)")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or args.seq < 2 or args.rank < 1 or (args.layers is not None and args.layers < 1):
        ap.error("--steps >= 2, --batch >= 1, --seq >= 2, --rank >= 1 and --layers >= 1 are needed")
    if args.model == "tiny":
        args.random_weights = True
    elif args.model in ARCHS and not args.random_weights:
        ap.error(f"--model {args.model} names an architecture whose weights are not here: add --random-weights, "
                 f"or pass --model DIR with a downloaded checkpoint")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible here; run on a GPU machine, or use --device cpu")
        return 1
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    with tempfile.TemporaryDirectory(prefix="lora-large-") as scratch:
        path = model_dir(args, os.path.join(scratch, "config"))
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(path, **({"num_hidden_layers": args.layers} if args.layers else {}))
        print(f"model: {args.model} ({cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
              f"{'random weights' if args.random_weights else 'weights from ' + path}), LoRA r={args.rank} on "
              f"{', '.join(TARGETS)}; quantize={args.quantize}, prefer={args.prefer}; {device}, "
              f"{'bf16' if device == 'cuda' else 'fp32'}, batch {args.batch}x{args.seq}, {args.steps} steps")
        try:
            stock = run("stock", args, path, device, os.path.join(scratch, "stock")) if args.compare else None
            mine = run("tsd", args, path, device, os.path.join(scratch, "tsd"))
        except trainstream.DaemonUnavailable as e:
            print(f"FAIL: no tsd to train through: {e}")
            return 1
    for e in mine["events"]:
        print(f"  tsd: {e}")
    print(f"base: {mine['quantized'] or 'not quantized'} while loading")
    rows = [("TrainStreamTrainer", mine)] + ([("stock Trainer + peft", stock)] if stock else [])
    for name, r in rows:
        peak = format_bytes(r["peak"]) if r["peak"] is not None else "n/a (CPU)"
        print(f"{name:>22}: losses {' '.join(f'{x:.4f}' for x in r['losses'])}; median step {r['step_s']:.3f} s; "
              f"peak VRAM {peak}")
    ok = check(bool(mine["in_tsd"]) and all("lora_" in n for n in mine["in_tsd"]),
               f"only the adapters are trained in tsd ({len(mine['in_tsd'])} tensors)")
    ok &= check(mine["base_unchanged"], "the frozen base is unchanged")
    ok &= check(mine["adapters_changed"], "the adapters changed")
    ok &= check(len(mine["losses"]) == args.steps and all(math.isfinite(x) for x in mine["losses"]),
                f"{args.steps} finite losses")
    if stock is not None:
        tol = 2e-2 if device == "cuda" else 2e-4
        diff = max(abs(a - b) for a, b in zip(mine["losses"], stock["losses"]))
        ok &= check(len(stock["losses"]) == len(mine["losses"]) and diff <= tol,
                    f"the losses equal the stock Trainer's (largest difference {diff:.2e}, tolerance {tol:g})")
        print(f"step time: {mine['step_s'] / stock['step_s']:.2f}x the stock Trainer's")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
