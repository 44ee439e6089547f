"""TRL's SFTTrainer through tsd (trainstream.integrations.trl.TrainStreamSFTTrainer) against the
stock SFTTrainer: a tiny Llama config and a word-level tokenizer saved by the test (no hub), a tiny
in-memory text dataset; equal losses over 6 steps with clipping and accumulation, full fine-tune
and LoRA through TRL's peft_config=, and the refusals SFTTrainer inherits."""
from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.trl import TrainStreamSFTTrainer  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat rug red blue big small fast slow and then it was "
         "here there home away").split()
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required"))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = str(tmp_path_factory.mktemp("sft") / "llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def dataset(n: int = 24):
    g = torch.Generator().manual_seed(3)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(4, 12, (1,), generator=g)),),
                                                             generator=g)) for _ in range(n)]
    return datasets.Dataset.from_dict({"text": texts})


def config(out, device="cpu", **kw):
    base = dict(output_dir=str(out), use_cpu=device == "cpu", per_device_train_batch_size=2, max_steps=6, learning_rate=2e-3,
                weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no",
                report_to=[], seed=0, disable_tqdm=True, max_grad_norm=0.1, gradient_accumulation_steps=2,
                bf16=False, gradient_checkpointing=False, max_length=32, dataset_num_proc=None)
    base.update(kw)
    return trl.SFTConfig(**base)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def grad_norms(trainer):
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("lora", [False, True])
def test_sft_losses_equal_stock_sfttrainer(tsd, tmp_path, checkpoint, tokenizer, lora, device):
    """6 steps with clipping (0.1 bites) and 2-step accumulation, overlap_forward on (the Trainer's
    default): the same losses (within 2e-4), grad norms and weights as trl.SFTTrainer; with peft_config= only the adapters are in tsd. On
    CUDA the model is passed on the CPU and the Trainer moves it (both runs)."""
    extra = {}
    if lora:
        peft = pytest.importorskip("peft")
        extra = {"peft_config": peft.LoraConfig(**LORA)}
    ref_model = load(checkpoint)
    model = copy.deepcopy(ref_model)
    ref = trl.SFTTrainer(model=ref_model, args=config(tmp_path / "ref", device), train_dataset=dataset(),
                         processing_class=tokenizer, **extra)
    ref.train()
    ts = TrainStreamSFTTrainer(model=model, args=config(tmp_path / "ts", device), train_dataset=dataset(),
                               processing_class=tokenizer, trainstream={"socket": tsd.socket}, **extra)
    try:
        ts.train()
        opt = ts.trainstream_optimizer
        assert opt is not None and opt.offloading  # the steps ran in tsd
        assert next(ts.model.parameters()).device.type == device
        trained = {id(ps.param) for ps in ts.trainstream_session.params}
        names = {n for n, p in ts.model.named_parameters() if id(p) in trained}
        # SFTTrainer registers no callback of its own: the updates overlapped the next forward
        assert any("finish during the next forward" in e for e in ts.trainstream_session.events)
    finally:
        if trainstream.unwrap_session(ts.model) is not None:
            trainstream.unwrap(ts.model)
    assert len(losses(ts)) == 6
    assert losses(ts) == pytest.approx(losses(ref), abs=2e-4)
    assert grad_norms(ts) == pytest.approx(grad_norms(ref), rel=1e-4)
    assert any(g > 0.1 for g in grad_norms(ts))  # clipping changed something
    if lora:
        assert len(names) == 2 * 2 * 2 and all("lora_" in n for n in names)  # layers x (q, v) x (A, B)
        assert all(p.abs().max() > 0 for n, p in ts.model.named_parameters() if "lora_B" in n)  # 0 at the start
    else:
        assert len(names) == sum(1 for _ in load(checkpoint).parameters())
        start = dict(load(checkpoint).named_parameters())
        assert all(not torch.equal(p.detach().cpu(), start[n]) for n, p in ts.model.named_parameters())  # all trained
    ref_params = dict(ref.model.named_parameters())
    diff = max((p.detach() - ref_params[n].detach()).abs().max().item() for n, p in ts.model.named_parameters())
    assert diff < 1e-5


def test_sft_refuses_fp16_before_building_anything(tsd, tmp_path, checkpoint, tokenizer):
    with pytest.raises(NotImplementedError, match="bf16=True"):
        TrainStreamSFTTrainer(model=load(checkpoint), args=config(tmp_path, fp16=True), train_dataset=dataset(),
                              processing_class=tokenizer, trainstream={"socket": tsd.socket})


def test_sft_refuses_unknown_trainstream_option(tsd, tmp_path, checkpoint, tokenizer):
    with pytest.raises(TypeError, match="unknown options"):
        TrainStreamSFTTrainer(model=load(checkpoint), args=config(tmp_path), train_dataset=dataset(),
                              processing_class=tokenizer, trainstream={"socket": tsd.socket, "moment": "bf16"})
