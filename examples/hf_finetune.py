"""Fine-tune a Hugging Face causal LM through TrainStreamTrainer, optionally next to the stock Trainer.

TrainStreamTrainer is transformers.Trainer with AdamW, gradient clipping, accumulation and the
optimizer state in tsd (trainstream.integrations.huggingface). By default the model is a tiny
Llama built from a config (no download); --model DIR takes any local checkpoint directory
(config.json and weights; its tokenizer is used when it has one). The text is the repository's
README, tokenized (or taken as bytes without a tokenizer).

    python examples/hf_finetune.py [--model DIR] [--device cpu|cuda] [--steps 12] [--lora]
                                   [--bf16] [--gradient-checkpointing] [--compare] [--socket PATH]

With --compare the stock Trainer trains the same weights on the same batches first; the losses
are printed side by side with the step times and the peak memory of each (each run in a process
of its own: peak VRAM on CUDA, the process's peak RSS on the CPU), and PASS/FAIL says
whether TrainStreamTrainer's losses equal the stock ones (within 2e-4, 2e-3 with --bf16).
tsd must be running (scripts/run-main.sh starts one); the socket defaults to $TSD_SOCKET, then
tsd's default path.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import trainstream
from trainstream.integrations.huggingface import TrainStreamTrainer
from trainstream.units import format_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (forward, backward, the update), synchronized on CUDA."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)


class TextDataset(torch.utils.data.Dataset):
    """Consecutive windows of `seq` tokens of the README (labels = inputs: causal LM)."""

    def __init__(self, ids: torch.Tensor, seq: int) -> None:
        self.windows = ids[: len(ids) // seq * seq].view(-1, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def tiny_llama(directory: str) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def tokens(model_dir: str, vocab: int) -> torch.Tensor:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        return torch.tensor(tok(text)["input_ids"], dtype=torch.long) % vocab
    except (OSError, ValueError):
        return torch.tensor(list(text.encode()), dtype=torch.long) % vocab  # no tokenizer: bytes


def load(model_dir: str, lora: bool) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        import peft
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def run(kind: str, opts, model_dir: str, data, out: str) -> dict:
    """One training run, in a process of its own (see in_child): its peak memory is its own."""
    if opts.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = load(model_dir, opts.lora)
    args = TrainingArguments(output_dir=out, use_cpu=opts.device == "cpu", per_device_train_batch_size=opts.batch,
                             gradient_accumulation_steps=opts.accumulation, max_steps=opts.steps,
                             learning_rate=opts.lr, weight_decay=0.1, warmup_steps=2, max_grad_norm=opts.max_grad_norm,
                             bf16=opts.bf16, gradient_checkpointing=opts.gradient_checkpointing, logging_steps=1,
                             save_strategy="no", report_to=[], seed=0, disable_tqdm=True, log_level="error")
    timer = StepTimer()
    if opts.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if kind == "stock":
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    else:
        trainer = TrainStreamTrainer(model=model, args=args, train_dataset=data, callbacks=[timer],
                                     trainstream={"socket": opts.socket} if opts.socket else {})
    trainer.remove_callback(PrinterCallback)  # the table at the end shows the losses
    trainer.train()
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "times": timer.times,
              "peak": torch.cuda.max_memory_allocated() if opts.device == "cuda" else None,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "events": [h["trainstream"] for h in trainer.state.log_history if "trainstream" in h]}
    session = trainstream.unwrap_session(model)
    if session is not None:
        result["in_tsd"] = session.state_bytes
        trainstream.unwrap(model)
    return result


def in_child(fn, *args):
    """fn(*args) in a fresh process: each run's peak RSS and VRAM are then its own (a process's
    peak never goes down, and freed memory is not always given back)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def describe(name: str, r: dict, device: str) -> str:
    steady = r["times"][1:] or r["times"]
    mem = (f"peak VRAM {format_bytes(r['peak'])}" if r["peak"] is not None
           else f"peak RSS {format_bytes(r['peak_rss'])}")
    tsd = f", optimizer state in tsd {format_bytes(r['in_tsd'])}" if "in_tsd" in r else ""
    return f"{name:>14}: median step {statistics.median(steady) * 1e3:8.1f} ms on {device}, {mem}{tsd}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local Hugging Face checkpoint directory (default: a tiny Llama config)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft)")
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compare", action="store_true", help="train with the stock Trainer too and compare")
    ap.add_argument("--socket", help="tsd's socket (default $TSD_SOCKET, then tsd's default)")
    opts = ap.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available here; pass --device cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = opts.model or tiny_llama(os.path.join(tmp, "tiny-llama"))
        vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
        data = TextDataset(tokens(model_dir, vocab), opts.seq)
        need = opts.steps * opts.batch * opts.accumulation
        print(f"model {opts.model or 'tiny Llama (4 layers, hidden 128)'}, {'LoRA' if opts.lora else 'full fine-tune'}, "
              f"{opts.steps} steps of {opts.accumulation} x {opts.batch} x {opts.seq} tokens on {opts.device}"
              f"{', bf16' if opts.bf16 else ''}{', gradient checkpointing' if opts.gradient_checkpointing else ''}; "
              f"{len(data)} windows of text ({'repeated' if need > len(data) else 'enough'} for {need})")
        stock = in_child(run, "stock", opts, model_dir, data, os.path.join(tmp, "stock")) if opts.compare else None
        ts = in_child(run, "trainstream", opts, model_dir, data, os.path.join(tmp, "ts"))
    for e in ts["events"]:
        print(f"tsd: {e}")
    print(f"\n{'step':>4} {'TrainStream':>12}" + (f" {'stock':>12} {'|diff|':>9}" if stock else ""))
    for i, loss in enumerate(ts["losses"]):
        line = f"{i + 1:>4} {loss:>12.6f}"
        if stock:
            line += f" {stock['losses'][i]:>12.6f} {abs(loss - stock['losses'][i]):>9.2e}"
        print(line)
    print()
    if stock:
        print(describe("stock Trainer", stock, opts.device))
    print(describe("TrainStream", ts, opts.device))
    if not stock:
        return 0
    tol = 2e-3 if opts.bf16 else 2e-4
    worst = max(abs(a - b) for a, b in zip(ts["losses"], stock["losses"]))
    ok = len(ts["losses"]) == len(stock["losses"]) and worst <= tol
    print(f"\n{'PASS' if ok else 'FAIL'}: TrainStreamTrainer's losses {'equal' if ok else 'differ from'} the stock "
          f"Trainer's (largest difference {worst:.2e}, tolerance {tol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
