"""PASS/FAIL: train a model whose weights do not fit the GPU, by paging its blocks' weights from tsd.

The model (an embedding, a stack of MLP blocks, a head) is built on the CPU. On CUDA, the process's
VRAM is capped below the model's weights with torch.cuda.set_per_process_memory_fraction, and
`trainstream.wrap(..., param_offload="auto")` lets the block planner choose which blocks' weights
live in tsd's memory and visit the GPU only while forward or backward needs them (the planner then
refines the split from the measured peaks). It checks:
  * the model's weights are larger than the cap (it could not be trained resident);
  * some blocks are paged, the loss falls, and torch's peak allocation stays under the cap.

Without CUDA (or with --device cpu) there is no VRAM to cap; the same pager then runs on the CPU
with every block paged (param_offload=True: the weights live in tsd's memory and are brought in
block by block), and it checks that the paged run's losses equal an unpaged tsd run's exactly and
that the loss falls.

    python examples/train_bigger_than_vram.py [--socket PATH] [--device auto|cuda|cpu]
        [--width 1024] [--blocks 16] [--steps 12] [--cap-fraction 0.6] [--cap-gib G]

tsd must be running (scripts/run-main.sh starts one); the socket defaults to $TSD_SOCKET, then
tsd's default path. Exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

import trainstream
from trainstream.units import format_bytes


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    """A language model of `n` MLP blocks: `blocks` is the repeated stack the pager pages."""

    def __init__(self, d: int, n: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(args: argparse.Namespace) -> Stack:
    torch.manual_seed(0)
    return Stack(args.width, args.blocks, args.vocab)  # on the CPU


def data(args: argparse.Namespace, device: str) -> list[torch.Tensor]:
    """One fixed batch, trained on at every step: the loss must fall on it."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        b = batches[i % len(batches)]
        logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def check(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return ok


def hyper() -> dict[str, Any]:
    return dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)


def run_cuda(args: argparse.Namespace) -> bool:
    model = make(args)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.cap_gib * 2**30) if args.cap_gib else int(weights * args.cap_fraction)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    print(f"model: {args.blocks} blocks of width {args.width}, {format_bytes(weights)} of fp32 weights, built on "
          f"the CPU; VRAM capped at {format_bytes(cap)} (torch.cuda.set_per_process_memory_fraction)")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **hyper()), device="cuda",
                                  socket=args.socket, offload=True, param_offload="auto")
    try:
        s = trainstream.unwrap_session(model)
        assert s is not None and s.pager is not None
        first = sorted(s.pager.paged)
        try:
            losses = train(model, opt, data(args, "cuda"), args.steps)
        except torch.OutOfMemoryError:
            for e in s.events:  # what the planner decided up to here: why it did not fit
                print(f"  tsd: {e}")
            raise
        opt.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        final = sorted(s.pager.paged)
        for e in s.events:
            print(f"  tsd: {e}")
    finally:
        trainstream.unwrap(model)
    print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
    print(f"paged blocks: first {first}, after {args.steps} steps {final}; peak allocated {format_bytes(peak)}")
    ok = check(weights > cap, f"the weights ({format_bytes(weights)}) are larger than the VRAM cap ({format_bytes(cap)})")
    ok &= check(len(final) > 0, f"{len(final)} of {args.blocks} blocks are paged from tsd's memory")
    ok &= check(losses[-1] < losses[0], f"the loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})")
    ok &= check(peak <= cap, f"the peak allocation ({format_bytes(peak)}) stays under the cap ({format_bytes(cap)})")
    return ok


def tsd_run(args: argparse.Namespace, param_offload: Any) -> tuple[list[float], Optional[int], list[str]]:
    model = make(args)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **hyper()), device="cpu",
                                  socket=args.socket, offload=True, param_offload=param_offload)
    try:
        s = trainstream.unwrap_session(model)
        assert s is not None
        paged = s.pager.trained_paged_bytes if s.pager is not None else None
        losses = train(model, opt, data(args, "cpu"), args.steps)
        events = list(s.events)
    finally:
        trainstream.unwrap(model)
    return losses, paged, events


def run_cpu(args: argparse.Namespace) -> bool:
    reason = "--device cpu" if args.device == "cpu" else "no CUDA device here"
    print(f"{reason}: a VRAM cap needs a CUDA GPU (run with --device cuda there). On the CPU this shows the same "
          f"weight paging: every block's weights live in tsd's memory and are brought in block by block, and the "
          f"run is compared with an unpaged one.")
    weights = sum(p.numel() * p.element_size() for p in make(args).parameters())
    print(f"model: {args.blocks} blocks of width {args.width}, {format_bytes(weights)} of fp32 weights")
    ref, _, _ = tsd_run(args, False)
    losses, paged, events = tsd_run(args, True)
    for e in events:
        print(f"  tsd: {e}")
    print(f"losses, unpaged: {' '.join(f'{x:.4f}' for x in ref)}")
    print(f"losses, paged:   {' '.join(f'{x:.4f}' for x in losses)}")
    ok = check(bool(paged), f"{format_bytes(paged or 0)} of trained weights are paged from tsd's memory")
    ok &= check(losses == ref, "the paged run's losses equal the unpaged run's exactly")
    ok &= check(losses[-1] < losses[0], f"the loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})")
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="tsd's socket (default $TSD_SOCKET, then tsd's default path)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--width", type=int, default=1024, help="model width (a block has 8 * width^2 weights)")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cap-fraction", type=float, default=0.6,
                    help="the VRAM cap as a fraction of the model's weights (CUDA; default 0.6)")
    ap.add_argument("--cap-gib", type=float, default=None, help="the VRAM cap in GiB (overrides --cap-fraction)")
    args = ap.parse_args(argv)
    if args.width < 1 or args.blocks < 2 or args.steps < 2 or not 0 < args.cap_fraction:
        ap.error("--width >= 1, --blocks >= 2, --steps >= 2 and --cap-fraction > 0 are needed")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible here; run on a GPU machine, or use --device cpu")
        return 1
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    try:
        ok = run_cuda(args) if use_cuda else run_cpu(args)
    except trainstream.DaemonUnavailable as e:
        print(f"FAIL: no tsd to train through: {e}")
        return 1
    except torch.OutOfMemoryError as e:
        print(f"FAIL: the run went over the VRAM cap ({str(e).splitlines()[0]}); paging should have kept it under")
        return 1
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
