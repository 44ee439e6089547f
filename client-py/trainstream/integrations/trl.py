"""`TrainStreamSFTTrainer`: TRL's `SFTTrainer` with its optimizer in tsd.

    from trl import SFTConfig
    from trainstream.integrations.trl import TrainStreamSFTTrainer
    trainer = TrainStreamSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                    processing_class=tokenizer, trainstream={"moment_dtype": "bfloat16"})
    trainer.train()

It is `TrainStreamMixin` (trainstream.integrations.trainer) put in front of `trl.SFTTrainer`, so
everything `TrainStreamTrainer` does holds here too: AdamW as the `SFTConfig` describes it, with
clipping (`max_grad_norm`) and accumulation (`gradient_accumulation_steps`) inside tsd, tsd's
`grad_norm` in the logs, checkpoints streamed by tsd and resumed from, peft adapters (TRL's
`peft_config=`) trained while the base stays frozen. SFTTrainer's own work (tokenizing,
packing, completion-only loss, its metrics) is untouched.

Two of `SFTConfig`'s defaults differ from `TrainingArguments`': `bf16` (on unless fp16 is asked
for) and `gradient_checkpointing` (on). Both work under tsd; fp16 is refused, as for every Trainer.
TRL's own `activation_offloading=True` moves saved activations to the CPU through torch's hooks;
prefer tsd's `trainstream={"activation_offload": ...}`, which pages them into tsd's pinned memory.

Tested with trl 1.16.0 on transformers 5.17.0 (tests/python/test_trl.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .trainer import TrainStreamMixin

try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"trainstream.integrations.trl needs TRL ({e}): pip install trl==1.16.0") from None

__all__ = ["TrainStreamSFTTrainer"]

if TYPE_CHECKING:
    _SFT = Any
else:
    _SFT = SFTTrainer


class TrainStreamSFTTrainer(TrainStreamMixin, _SFT):  # type: ignore[misc]
    """TRL's `SFTTrainer` with AdamW, clipping, accumulation and the optimizer state in tsd.
    Takes SFTTrainer's arguments plus `trainstream={...}`, the options of `trainstream.wrap()`
    (offload defaults to True; max_grad_norm and accumulation_steps come from `args`). Refuses what
    `TrainStreamTrainer` refuses (fp16, AMSGrad, other optimizers, several processes with
    `distributed=False`); several processes otherwise train data parallel through tsd, as there."""
