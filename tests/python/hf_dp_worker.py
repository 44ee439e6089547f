"""One rank of a data-parallel Hugging Face Trainer run on the CPU, for test_hf_trainer_dp.py.

The test starts `world` of these as processes with the environment a launcher (torchrun,
accelerate launch) sets: accelerate then sees a multi-process CPU run, initializes the gloo group,
and shards each batch over the ranks. `mode` picks the trainer: "stock" is transformers.Trainer
(accelerate wraps the model in DistributedDataParallel and each rank runs torch's AdamW),
"tsd" is TrainStreamTrainer (the ranks share one optimizer in tsd, wrap(distributed="auto")).
Each rank writes its logged losses and grad norms, its final parameters and what tsd showed into
`out_dir/<mode>-rank<r>.pt`; an exception is written there instead of results."""
from __future__ import annotations

import os
import traceback
from typing import Any, Optional

import torch

from hf_data import TokenDataset


def main(rank: int, world: int, port: int, mode: str, checkpoint: str, out_dir: str, socket: str,
         run: dict[str, Any], resume: Optional[str] = None, tag: str = "") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    path = os.path.join(out_dir, f"{tag or mode}-rank{rank}.pt")
    try:
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        from trainstream.integrations.huggingface import TrainStreamTrainer

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
        args = TrainingArguments(output_dir=os.path.join(out_dir, tag or mode), use_cpu=True, ddp_backend="gloo",
                                 per_device_train_batch_size=2, learning_rate=2e-3, weight_decay=0.1,
                                 lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=[], seed=0,
                                 disable_tqdm=True, max_grad_norm=0.1, gradient_accumulation_steps=2,
                                 dataloader_num_workers=0, **run)
        if mode == "stock":
            trainer = Trainer(model=model, args=args, train_dataset=TokenDataset())
        else:
            trainer = TrainStreamTrainer(model=model, args=args, train_dataset=TokenDataset(),
                                         trainstream={"socket": socket})
        trainer.train(resume_from_checkpoint=resume)
        out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        out["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        out["ddp"] = type(trainer.model_wrapped).__name__
        if mode == "tsd":
            session = trainer.trainstream_session
            assert session is not None and session.dp is not None
            out["world"], out["local_world"] = session.dp.world, session.dp.local_world
            out["job"] = session.client.job
            import trainstream
            with trainstream.connect(socket=socket) as c:
                jobs = [j for j in c.jobs() if j.name == session.client.job]
            out["sessions"] = jobs[0].sessions if jobs else 0
            out["used_bytes"] = jobs[0].used_bytes if jobs else 0
            out["state_bytes"] = session.state_bytes
            torch.distributed.barrier()  # every rank read the job before any unwraps
            trainstream.unwrap(model)
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    except BaseException as e:  # the test reads it; the other ranks fail on their collectives
        out = {"exception": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    torch.save(out, path)
