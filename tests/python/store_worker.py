"""A trainer process for tests/python/test_stores.py: loads a checkpoint through a tsd weight
store, trains LoRA adapters on it through tsd, and reports as JSON lines on stdout.

    python store_worker.py SOCKET CHECKPOINT_DIR JOB STEPS

It prints {"loaded": ...} once the model is built, then waits for a line on stdin before it
trains (so a test can have two of them hold one store and train at the same time), and prints
{"losses": [...]} at the end."""
from __future__ import annotations

import json
import sys

import torch


def lora_losses(model: torch.nn.Module, socket: str, job: str, steps: int) -> list[float]:
    """LoRA r=4 on q_proj and v_proj (seed 0), AdamW through tsd, `steps` steps on fixed tokens."""
    import peft

    import trainstream

    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=socket, job=job)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    trainstream.unwrap(model)
    return losses


def main() -> None:
    socket, path, job, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import trainstream
    from trainstream.integrations.huggingface import load_model

    client = trainstream.connect(socket=socket, job=f"{job}-store")
    model = load_model(path, quantize="nf4", store=client)
    info = dict(model._ts_load_info)
    print(json.dumps({"loaded": {k: info[k] for k in ("store", "store_built", "bytes_read")}}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"losses": lora_losses(model, socket, job, steps)}), flush=True)


if __name__ == "__main__":
    main()
