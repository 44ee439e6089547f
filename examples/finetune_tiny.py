"""The main job: fine-tune a small GPT through tsd and show that it trains exactly like stock AdamW.

A character-level GPT learns the repository's README. The same model is trained twice from the
same weights on the same batches: once with stock torch.optim.AdamW, once through
trainstream.wrap(), where the optimizer state lives in tsd and tsd's CPU threads run AdamW while
backward goes on. The losses are printed side by side, then where the memory lives.

    python examples/finetune_tiny.py [--socket PATH] [--device cpu|cuda] [--steps 30]

tsd must be running (scripts/run-main.sh starts one); the socket defaults to $TSD_SOCKET, then
tsd's default path.
"""
import argparse
import copy
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import trainstream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, d=64, layers=3, heads=4, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), len(chars)


def batches(data, n, batch, seq, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (n, batch), generator=g)
    return [torch.stack([data[s:s + seq + 1] for s in row]).to(device) for row in starts]


def run(model, opt, sched, data, accumulation):
    losses = []
    it = iter(data)
    for _ in range(len(data) // accumulation):
        total = 0.0
        for _ in range(accumulation):
            t = next(it)
            logits = model(t[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1)) / accumulation
            loss.backward()
            total += loss.item()
        if not hasattr(opt, "offloading"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # trainstream clips inside tsd
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def fmt(n):
    return f"{n / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--accumulation", type=int, default=2)
    a = ap.parse_args()
    dev = torch.device(a.device)
    data, vocab = corpus()
    torch.manual_seed(0)
    base = TinyGPT(vocab).to(dev)
    stock, mine = copy.deepcopy(base), copy.deepcopy(base)
    nparams = sum(p.numel() for p in base.parameters())
    print(f"fine-tuning a {nparams / 1e6:.2f}M-parameter character GPT on README.md ({len(data)} characters) on {dev}, "
          f"{a.steps} steps of {a.accumulation} micro-batches")
    lr_at = lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / a.steps))  # noqa: E731
    hp = dict(lr=1e-3, betas=(0.9, 0.95))
    train_data = batches(data, a.steps * a.accumulation, 8, 64, dev)

    opt_stock = torch.optim.AdamW(groups(stock), foreach=False, **hp)
    t0 = time.perf_counter()
    l_stock = run(stock, opt_stock, torch.optim.lr_scheduler.LambdaLR(opt_stock, lr_at), train_data, a.accumulation)
    t_stock = time.perf_counter() - t0

    try:
        mine, opt = trainstream.wrap(mine, torch.optim.AdamW(groups(mine), **hp), device=a.device, socket=a.socket,
                                     max_grad_norm=1.0, accumulation_steps=a.accumulation, offload=True)
    except trainstream.DaemonUnavailable as e:
        sys.exit(f"finetune_tiny: {e}")
    session = trainstream.unwrap_session(mine)
    t0 = time.perf_counter()
    l_tsd = run(mine, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at), train_data, a.accumulation)
    t_tsd = time.perf_counter() - t0
    with trainstream.connect(socket=a.socket) as c:
        job = next(j for j in c.jobs() if j.name == session.client.job)
        pool = c.status()

    print(f"\n{'step':>4}  {'stock AdamW':>12}  {'through tsd':>12}  {'difference':>10}")
    for i, (x, y) in enumerate(zip(l_stock, l_tsd)):
        if i < 5 or i % 5 == 4 or i == len(l_stock) - 1:
            print(f"{i + 1:>4}  {x:>12.6f}  {y:>12.6f}  {abs(x - y):>10.2e}")
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(stock.parameters(), mine.parameters()))
    print(f"\nmax |parameter difference| after {a.steps} steps: {diff:.3g}  "
          f"(loss {l_stock[0]:.3f} -> {l_tsd[-1]:.3f}; {t_stock:.2f} s stock, {t_tsd:.2f} s through tsd)")

    print("\nwhere the memory lives:")
    print(f"  tsd (job {job.name!r}): {fmt(job.used_bytes)} of locked host memory in {job.regions} regions: fp32 master "
          f"weights, both AdamW moments ({opt.moment_dtype}), gradient and parameter slots, the accumulator")
    print(f"  tsd's pool: {fmt(pool.used_bytes)} used of {fmt(pool.pool_bytes)} (locked in RAM: {pool.locked})")
    state_in_process = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                           if torch.is_tensor(t))
    print(f"  this process: optimizer state {fmt(state_in_process)}; gradients freed as they stream out "
          f"(all .grad None: {all(p.grad is None for p in mine.parameters())}); max RSS "
          f"{fmt(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}")
    if dev.type == "cuda":
        print(f"  GPU: weights {fmt(sum(p.numel() * p.element_size() for p in mine.parameters()))}, "
              f"peak {fmt(torch.cuda.max_memory_allocated(dev))}")
    print(f"  AdamW ran on {session.handle.threads} tsd threads ({session.handle.isa} kernels)")
    trainstream.unwrap(mine)
    ok = diff <= 1e-5 and l_tsd[-1] < l_tsd[0]
    print("\nfinetune_tiny: " + ("OK: tsd trained the model like stock AdamW" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
