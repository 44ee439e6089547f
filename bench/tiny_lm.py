"""A tiny causal language model in plain torch (no transformers), called the way the benchmark
calls a Hugging Face model: `model(input_ids=ids, labels=ids).loss`. It is the `--arch tiny`
workload of finetune_bench.py, so the benchmark's pipeline can be exercised on a CPU in CI; its
figures say nothing about large models."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512)


class TinyCausalLM(nn.Module):
    """Token embedding, pre-norm transformer blocks with a causal mask, and a head tied to the
    embedding; the loss is next-token cross entropy, as in a Hugging Face causal LM."""

    def __init__(self, hidden_size: int, num_hidden_layers: int, num_attention_heads: int, intermediate_size: int,
                 vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden_size, num_attention_heads, intermediate_size, dropout=0.0,
                                       batch_first=True, norm_first=True) for _ in range(num_hidden_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, 0.0, 0.02)  # GPT-2's scale: a loss near log(vocab) at the start

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        t = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab_size).float(), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)
