"""The token data the Hugging Face tests train on, and their plain training loop, shared by the
in-process tests and the data-parallel worker processes (which cannot import a test module)."""
from __future__ import annotations

import torch

VOCAB, SEQ = 96, 16


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, the same on every call and in every rank (the labels are the
    inputs: causal LM)."""

    def __init__(self, n: int = 48) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_causal_lm(model, opt, batches) -> list:
    """Trains a causal LM one step per batch of token ids (the labels are the inputs); the losses."""
    model.train()
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
