"""A small GPT and the training loops the tests compare: the same code drives a stock torch
optimizer (the reference) and a trainstream-wrapped one."""
import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No bias on q, k, v: a key bias gets a gradient that is zero up to rounding noise, which
        # AdamW (dividing by its own tiny second moment) turns into updates of noise: last-bit
        # differences between two correct AdamW implementations would then grow without bound.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final LayerNorm and a head tied to the
    token embedding (tied weights)."""

    def __init__(self, d=32, layers=2, heads=4, vocab=VOCAB, seq=SEQ, tie=True):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_gpt(seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return GPT(**kw).to(dtype)


def param_groups(model, wd=0.1, lr2=None):
    """nanoGPT's split: weight decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    g2 = {"params": rest, "weight_decay": 0.0}
    if lr2 is not None:
        g2["lr"] = lr2
    return [{"params": decay, "weight_decay": wd}, g2]


def batches(n, seed=1, batch=4, seq=SEQ, vocab=VOCAB, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device) for _ in range(n)]


def loss_of(model, t):
    logits = model(t[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1))


def train(model, opt, data, steps, accumulation=1, max_grad_norm=None, scheduler=None, stock=False):
    """`steps` optimizer steps of `accumulation` micro-batches each. With stock=True the loop
    clips .grad itself (torch's clip_grad_norm_); a wrapped optimizer clips inside tsd."""
    losses = []
    it = iter(data)
    for _ in range(steps):
        total = 0.0
        for _ in range(accumulation):
            loss = loss_of(model, next(it)) / accumulation
            loss.backward()
            total += loss.item()
        if stock and max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def max_diff(a, b):
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))
