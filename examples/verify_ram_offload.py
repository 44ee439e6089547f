"""PASS/FAIL: does training through tsd keep the optimizer's memory out of the training process
(and, on a GPU, out of VRAM)?

Trains the same model for a few steps with stock torch.optim.AdamW and through trainstream.wrap()
and checks, with measurements:
  * tsd holds the optimizer: the job's bytes in the daemon cover fp32 master weights, both moments
    and the gradient/parameter slots (about 16 bytes per parameter and more);
  * the training process holds no optimizer state and no gradients after backward;
  * on CUDA: the peak VRAM of the wrapped run is below the stock run's by at least 80% of what stock
    AdamW keeps on the GPU (its moments and gradients).

    python examples/verify_ram_offload.py [--socket PATH] [--device cuda|cpu] [--width 1024] [--layers 8]
"""
import argparse
import copy
import sys

import torch
from torch import nn

import trainstream


def make(width, layers, device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(device)


def steps(model, opt, n, width, device):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(64, width, generator=g).to(device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def peak(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    fn()
    return None


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device(a.device)
    checks = []

    stock = make(a.width, a.layers, dev)
    mine = copy.deepcopy(stock)
    nparams = sum(p.numel() for p in stock.parameters())
    opt_stock = torch.optim.AdamW(stock.parameters())
    stock_peak = peak(dev, lambda: steps(stock, opt_stock, a.steps, a.width, dev))
    stock_state = sum(t.numel() * t.element_size() for s in opt_stock.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)

    try:
        mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters()), device=a.device, socket=a.socket,
                                     offload=True)
    except trainstream.DaemonUnavailable as e:
        sys.exit(f"verify_ram_offload: {e}")
    session = trainstream.unwrap_session(mine)
    mine_peak = peak(dev, lambda: steps(mine, opt, a.steps, a.width, dev))
    with trainstream.connect(socket=a.socket) as c:
        held = next(j for j in c.jobs() if j.name == session.client.job).used_bytes

    print(f"model: {nparams:,} parameters ({mib(nparams * 4)} of fp32 weights) on {dev}")
    need = nparams * 16  # master 4 + exp_avg 4 + exp_avg_sq 4 + grad slot 4 (fp32 model), at least
    checks.append((held >= need, f"tsd holds {mib(held)} for this job (optimizer state and slots; at least {mib(need)} "
                                 f"expected)"))
    in_process = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    checks.append((in_process == 0, f"optimizer state in the training process: {mib(in_process)} "
                                    f"(stock AdamW kept {mib(stock_state)})"))
    loss = mine(torch.randn(8, a.width, device=dev)).pow(2).mean()
    loss.backward()
    checks.append((all(p.grad is None for p in mine.parameters()),
                   "gradients leave the process as backward produces them (every .grad is None after backward)"))
    opt.step()
    opt.zero_grad()
    if dev.type == "cuda":
        saved = stock_peak - mine_peak
        expect = stock_state + nparams * 4  # stock keeps both moments and the fp32 gradients in VRAM
        checks.append((saved >= 0.8 * expect, f"peak VRAM of a step: stock {mib(stock_peak)}, through tsd {mib(mine_peak)} "
                                              f"(saved {mib(saved)}; moments and gradients are {mib(expect)})"))
    trainstream.unwrap(mine)
    for ok, what in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    verdict = all(ok for ok, _ in checks)
    print("PASS" if verdict else "FAIL")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
