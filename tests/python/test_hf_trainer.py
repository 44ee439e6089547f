"""TrainStreamTrainer (trainstream.integrations.huggingface) against the stock transformers.Trainer
on tiny Llama and Qwen2 configs the tests save themselves (no hub): equal losses and grad norms
with clipping and accumulation, full fine-tune and LoRA, gradient checkpointing and bf16; a
checkpoint streamed by tsd and a resumed run that continues bit-identically; the mixin on another
Trainer subclass; each setting it refuses. The CUDA cases skip without a GPU."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import trainstream  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamMixin, TrainStreamTrainer  # noqa: E402
from trainstream.integrations.trainer import STATE_FILE, STATE_META_FILE  # noqa: E402

from hf_data import VOCAB, TokenDataset  # noqa: E402 (TokenDataset: also for test_hf_trainer_paging)

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
CUDA = pytest.param("cuda", marks=NO_CUDA)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama and a tiny Qwen2 (no dropout), saved once."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch, cfg_cls in (("llama", LlamaConfig), ("qwen2", Qwen2Config)):
        torch.manual_seed(0)
        cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
        out[arch] = str(root / arch)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out[arch])
    return out


def load(path, lora=False):
    # Eager attention: CUDA's fused attention backward may use atomics, which would make two runs
    # differ in their last bits whatever the optimizer (the resume test wants bit equality).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def targs(out, device="cpu", **kw):
    base = dict(output_dir=str(out), use_cpu=device == "cpu", per_device_train_batch_size=2, max_steps=6,
                learning_rate=2e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1,
                logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                max_grad_norm=0.1, gradient_accumulation_steps=2)
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def grad_norms(trainer):
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def max_diff(a, b):
    pa = dict(a.named_parameters())
    return max((p.detach().float().cpu() - pa[n].detach().float().cpu()).abs().max().item()
               for n, p in b.named_parameters())


def run_ts(tsd, model, args, cls=TrainStreamTrainer, resume=None, data=None, **options):
    data = data or {"train_dataset": TokenDataset()}
    trainer = cls(model=model, args=args, **data, trainstream={"socket": tsd.socket, **options})
    try:
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.trainstream_optimizer is not None and trainer.trainstream_optimizer.offloading
        trainer.tsd_trained = {id(ps.param) for ps in trainer.trainstream_session.params}
        trainer.tsd_events = list(trainer.trainstream_session.events)
    finally:
        if trainstream.unwrap_session(model) is not None:
            trainstream.unwrap(model)
    return trainer


def compare(tsd, tmp_path, path, device="cpu", lora=False, tol=2e-4, **kw):
    ref_model = load(path, lora)
    model = copy.deepcopy(ref_model)
    ref = Trainer(model=ref_model, args=targs(tmp_path / "ref", device, **kw), train_dataset=TokenDataset())
    ref.train()
    ts = run_ts(tsd, model, targs(tmp_path / "ts", device, **kw))
    assert len(losses(ts)) == 6
    assert losses(ts) == pytest.approx(losses(ref), abs=tol)
    return ref, ts, ref_model, model


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch,lora", [("llama", False), ("qwen2", False), ("llama", True), ("qwen2", True)])
def test_losses_equal_stock_trainer(tsd, tmp_path, checkpoints, device, arch, lora):
    """Clipping (0.1 bites here) and 2-step accumulation in tsd give the stock Trainer's losses,
    grad norms and weights; with LoRA only the adapters are trained."""
    ref, ts, ref_model, model = compare(tsd, tmp_path, checkpoints[arch], device, lora)
    assert next(model.parameters()).device.type == device  # passed on the CPU; on CUDA, moved there
    assert grad_norms(ts) == pytest.approx(grad_norms(ref), rel=1e-4)
    assert any(g > 0.1 for g in grad_norms(ts))  # the clipping changed something
    assert max_diff(ref_model, model) < 1e-5
    if lora:
        base = load(checkpoints[arch])
        trained = {n for n, p in model.named_parameters() if id(p) in ts.tsd_trained}
        assert len(trained) == 2 * 2 * 2 and all("lora_" in n for n in trained)  # layers x (q, v) x (A, B)
        for n, p in model.get_base_model().named_parameters():
            if "lora_" not in n:
                assert torch.equal(p.detach().cpu(), base.get_parameter(n.replace(".base_layer", ""))), n


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_gradient_checkpointing_and_bf16(tsd, tmp_path, checkpoints, device):
    """bf16 autocast (args.bf16) and gradient checkpointing: the gradients still reach tsd."""
    compare(tsd, tmp_path, checkpoints["llama"], device, gradient_checkpointing=True, bf16=True, tol=2e-3)


def test_short_last_step_and_evaluation(tsd, tmp_path, checkpoints):
    """One epoch of 7 micro-batches with accumulation 5: the last step has 2 (tsd closes the
    accumulation of that step itself); evaluation at every step sees the same weights."""
    data = {"train_dataset": TokenDataset(14), "eval_dataset": TokenDataset(4)}
    kw = dict(max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=5, eval_strategy="steps", eval_steps=1)
    ref_model = load(checkpoints["qwen2"])
    model = copy.deepcopy(ref_model)
    ref = Trainer(model=ref_model, args=targs(tmp_path / "ref", **kw), **data)
    ref.train()
    ts = run_ts(tsd, model, targs(tmp_path / "ts", **kw), data=data)
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ref, ts)]
    assert len(losses(ts)) == len(evals[1]) == 2
    assert losses(ts) == pytest.approx(losses(ref), abs=2e-4)
    assert evals[1] == pytest.approx(evals[0], abs=2e-4)
    assert max_diff(ref_model, model) < 1e-5


def test_events_and_grad_norm_in_the_logs(tsd, tmp_path, checkpoints):
    model = load(checkpoints["qwen2"])
    ts = run_ts(tsd, model, targs(tmp_path, max_steps=2))
    events = [h["trainstream"] for h in ts.state.log_history if "trainstream" in h]
    lines = [line for e in events for line in e.split("\n")]  # each event once, new ones joined by newlines
    assert any(line.startswith("wrap:") and "buckets" in line for line in lines)
    assert lines == ts.tsd_events  # every event of the session, each once, in order
    assert len(grad_norms(ts)) == 2 and all(g > 0 for g in grad_norms(ts))
    no_clip = run_ts(tsd, load(checkpoints["qwen2"]), targs(tmp_path / "nc", max_steps=2, max_grad_norm=0.0))
    assert grad_norms(no_clip) == []  # tsd computes no norm without clipping, and Trainer's .grad is empty


@pytest.mark.parametrize("device,options", [("cpu", {}), ("cpu", {"param_dtype": torch.bfloat16}),
                                            pytest.param("cuda", {}, marks=NO_CUDA)])
def test_checkpoint_and_resume_are_bit_identical(tsd, tmp_path, checkpoints, device, options):
    """save_steps=3: tsd streams its state into the checkpoint; a new process-like run resumed from
    it gives steps 4-6 and the final weights bit for bit (seeded sampler, no dropout). With bf16
    working copies the checkpoint's model is bf16 and the fp32 masters come from tsd's file."""
    from safetensors import safe_open
    path = checkpoints["llama"]
    whole = load(path)
    a = run_ts(tsd, whole, targs(tmp_path / "a", device, save_strategy="steps", save_steps=3), **options)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert (ckpt / STATE_FILE).is_file() and not (ckpt / "optimizer.pt").exists()
    meta = json.loads((ckpt / STATE_META_FILE).read_text())
    assert meta["steps"] == 3 and meta["moment_dtype"] == "float32"
    assert meta["state_bytes"] == os.path.getsize(ckpt / STATE_FILE)
    n_trained = sum(1 for p in whole.parameters() if p.requires_grad)
    with safe_open(str(ckpt / STATE_FILE), "pt") as f:
        assert len(list(f.keys())) == 4 * n_trained
        assert f.get_tensor("b0.step").tolist() == [3]
    resumed = load(path)
    b = run_ts(tsd, resumed, targs(tmp_path / "b", device), resume=str(ckpt), **options)
    assert losses(b) == losses(a)  # the first 3 come from the checkpoint's trainer state, the last 3 are new
    assert grad_norms(b) == grad_norms(a)
    assert max_diff(whole, resumed) == 0.0


@pytest.mark.parametrize("fraction", [0.5, "auto"])
def test_checkpoint_and_resume_with_a_gpu_share(tsd, tmp_path, checkpoints, fraction):
    """optimizer_gpu_fraction: part of the state is torch's on the device, so the checkpoint holds
    the optimizer as the stock Trainer's does (optimizer.pt, torch's layout, both shares); resumed
    from it, steps 4-6 and the final weights are bit for bit those of the uninterrupted run. "auto"
    (a CPU device with a VRAM budget) moves its share after the first step of each run, the
    resumed one's too."""
    path = checkpoints["llama"]
    whole = load(path)
    options = {"optimizer_gpu_fraction": fraction}
    if fraction == "auto":
        n = sum(p.numel() for p in whole.parameters() if p.requires_grad)
        options["budget"] = trainstream.Budget(vram_usable=6 * n)
    a = run_ts(tsd, whole, targs(tmp_path / "a", save_strategy="steps", save_steps=3), **options)
    chose = "after step 1" if fraction == "auto" else "optimizer_gpu_fraction=0.5"
    assert any(chose in e and "parameters" in e for e in a.tsd_events)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and not (ckpt / STATE_FILE).exists()
    resumed = load(path)
    b = run_ts(tsd, resumed, targs(tmp_path / "b"), resume=str(ckpt), **options)
    if fraction == "auto":
        # The resumed run decides again after its own first step (step 4), which tsd takes whole:
        # two AdamWs and two summation orders of the norm for that step, so within 1e-6, not bitwise.
        assert losses(b) == pytest.approx(losses(a), rel=1e-6)
        assert grad_norms(b) == pytest.approx(grad_norms(a), rel=1e-6)
        assert max_diff(whole, resumed) <= 1e-6
        return
    assert losses(b) == losses(a)
    assert grad_norms(b) == grad_norms(a)
    assert max_diff(whole, resumed) == 0.0


def test_resume_from_a_tsd_file_into_a_run_with_a_gpu_share(tsd, tmp_path, checkpoints):
    """A checkpoint written with the whole optimizer in tsd (its state file) resumes a run with
    optimizer_gpu_fraction=0.5: the file is loaded by parameter name, each parameter's state where
    it is now (tsd or the share's torch AdamW). Steps 4-6 then match the uninterrupted all-tsd run
    within 1e-6 (two AdamWs). A LoRA run is refused from it, changing nothing."""
    path = checkpoints["llama"]
    whole = load(path)
    a = run_ts(tsd, whole, targs(tmp_path / "a", save_strategy="steps", save_steps=3))
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert (ckpt / STATE_FILE).is_file()
    resumed = load(path)
    b = run_ts(tsd, resumed, targs(tmp_path / "b"), resume=str(ckpt), optimizer_gpu_fraction=0.5)
    assert any("optimizer_gpu_fraction=0.5" in e for e in b.tsd_events)
    assert losses(b) == pytest.approx(losses(a), rel=1e-6)
    assert grad_norms(b) == pytest.approx(grad_norms(a), rel=1e-6)
    assert max_diff(whole, resumed) <= 1e-6
    lora = load(path, lora=True)
    with pytest.raises(ValueError, match="other trained parameters"):
        run_ts(tsd, lora, targs(tmp_path / "c", max_steps=4), resume=str(ckpt), optimizer_gpu_fraction=0.5)


def test_resume_refuses_another_layout(tsd, tmp_path, checkpoints):
    run_ts(tsd, load(checkpoints["llama"]), targs(tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2))
    lora = load(checkpoints["llama"], lora=True)
    with pytest.raises(ValueError, match="other trained parameters"):
        run_ts(tsd, lora, targs(tmp_path / "b", max_steps=4), resume=str(tmp_path / "a" / "checkpoint-2"))


def test_resumes_a_stock_trainer_checkpoint(tsd, tmp_path, checkpoints):
    """optimizer.pt from the stock Trainer is loaded into tsd (TsdAdamW.load_state_dict)."""
    path = checkpoints["qwen2"]
    ref_model = load(path)
    ref = Trainer(model=ref_model, args=targs(tmp_path / "ref", save_strategy="steps", save_steps=3),
                  train_dataset=TokenDataset())
    ref.train()
    model = load(path)
    ts = run_ts(tsd, model, targs(tmp_path / "ts"), resume=str(tmp_path / "ref" / "checkpoint-3"))
    assert losses(ts) == pytest.approx(losses(ref), abs=2e-4)
    assert max_diff(ref_model, model) < 1e-5


class HalfLossTrainer(Trainer):
    """A Trainer subclass with its own loss, standing in for TRL's SFTTrainer."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 0.5


class TrainStreamHalfLoss(TrainStreamMixin, HalfLossTrainer):
    pass


def test_mixin_on_a_trainer_subclass(tsd, tmp_path, checkpoints):
    ref_model = load(checkpoints["llama"], lora=True)
    model = copy.deepcopy(ref_model)
    ref = HalfLossTrainer(model=ref_model, args=targs(tmp_path / "ref"), train_dataset=TokenDataset())
    ref.train()
    ts = run_ts(tsd, model, targs(tmp_path / "ts"), cls=TrainStreamHalfLoss)
    assert losses(ts) == pytest.approx(losses(ref), abs=2e-4)
    assert max_diff(ref_model, model) < 1e-5


# ---- refusals: a clear error when the trainer is built; the model stays unwrapped
def refused(tmp_path, checkpoints, match, exc=Exception, trainstream_opts=None, optimizers=(None, None), **kw):
    model = load(checkpoints["llama"])
    with pytest.raises(exc, match=match):
        TrainStreamTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=TokenDataset(),
                           optimizers=optimizers, trainstream=trainstream_opts)
    assert trainstream.unwrap_session(model) is None
    return model


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "adamw_torch_4bit"])
def test_refuses_other_optimizers(tmp_path, checkpoints, optim):
    refused(tmp_path, checkpoints, "tsd runs AdamW", ValueError, optim=optim)


def test_refuses_amsgrad(tmp_path, checkpoints):
    refused(tmp_path, checkpoints, "AMSGrad", NotImplementedError, optim_args="amsgrad=True")
    model = load(checkpoints["llama"])
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(NotImplementedError, match="AMSGrad"):
        TrainStreamTrainer(model=model, args=targs(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="SGD"):
        TrainStreamTrainer(model=model, args=targs(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None))


def test_refuses_fp16(tmp_path, checkpoints):
    args = targs(tmp_path)
    args.fp16 = True  # TrainingArguments itself refuses fp16 on the CPU; what a GPU run would pass
    with pytest.raises(NotImplementedError, match="GradScaler"):
        TrainStreamTrainer(model=load(checkpoints["llama"]), args=args, train_dataset=TokenDataset())


def test_refuses_several_processes_with_distributed_off(tmp_path, checkpoints, monkeypatch):
    # With the default distributed="auto" they train data parallel (test_hf_trainer_dp.py).
    args = targs(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotImplementedError, match="distributed=False"):
        TrainStreamTrainer(model=load(checkpoints["llama"]), args=args, train_dataset=TokenDataset(),
                           trainstream={"distributed": False})


def test_refuses_several_gpus(tmp_path, checkpoints, monkeypatch):
    args = targs(tmp_path)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))  # what 2 visible GPUs give
    with pytest.raises(NotImplementedError, match="CUDA_VISIBLE_DEVICES"):
        TrainStreamTrainer(model=load(checkpoints["llama"]), args=args, train_dataset=TokenDataset())


def test_refuses_options_that_come_from_the_args(tmp_path, checkpoints):
    refused(tmp_path, checkpoints, "max_grad_norm=", ValueError, trainstream_opts={"max_grad_norm": 1.0})
    refused(tmp_path, checkpoints, "gradient_accumulation_steps=", ValueError,
            trainstream_opts={"accumulation_steps": 2})
    refused(tmp_path, checkpoints, "unknown options", TypeError, trainstream_opts={"moments": "bf16"})


def test_overlap_forward_is_bit_identical_with_eval_and_checkpoints(tsd, tmp_path, checkpoints):
    """overlap_forward=True under the Trainer (step() returns before tsd's updates are copied back;
    each module's forward waits for its own): evaluation at every step, a checkpoint at step 3 (the
    model's safetensors and tsd's state) and the logged grad norms are bit for bit those of the
    waiting step, and so are the final weights."""
    from safetensors.torch import load_file
    path = checkpoints["qwen2"]
    data = {"train_dataset": TokenDataset(), "eval_dataset": TokenDataset(4)}
    kw = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=3)
    runs = {}
    for overlap in (False, True):
        model = load(path)
        t = run_ts(tsd, model, targs(tmp_path / str(overlap), **kw), data=data, overlap_forward=overlap)
        evals = [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h]
        ckpt = tmp_path / str(overlap) / "checkpoint-3"
        runs[overlap] = (losses(t), grad_norms(t), evals, load_file(str(ckpt / "model.safetensors")),
                         (ckpt / STATE_FILE).read_bytes(), model)
    (l0, g0, e0, s0, st0, m0), (l1, g1, e1, s1, st1, m1) = runs[False], runs[True]
    assert len(l1) == 6 and len(e1) == 6
    assert l1 == l0 and g1 == g0 and e1 == e0
    assert s1.keys() == s0.keys() and all(torch.equal(s1[k], s0[k]) for k in s0)
    assert st1 == st0
    assert max_diff(m0, m1) == 0.0


class ReadsWeights(TrainerCallback):
    """A callback of the user's that reads a weight directly after each step (as an EMA would)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.seen.append(model.lm_head.weight.detach().cpu().clone())


def test_overlap_forward_is_the_default_unless_a_foreign_callback_could_read_weights(tsd, tmp_path, checkpoints):
    """The Trainer turns overlap_forward on by default; a callback from another package turns it
    off (with an event saying why and how to turn it back on), so the weights it reads after each
    step are the updated ones, those of the stock Trainer; trainstream={'overlap_forward': ...}
    decides either way."""
    path = checkpoints["qwen2"]
    plain = run_ts(tsd, load(path), targs(tmp_path / "plain", max_steps=2))
    assert any(e.startswith("overlap_forward:") and "finish during the next" in e for e in plain.tsd_events)
    ref_cb, cb = ReadsWeights(), ReadsWeights()
    ref = Trainer(model=load(path), args=targs(tmp_path / "ref", max_steps=3), train_dataset=TokenDataset(),
                  callbacks=[ref_cb])
    ref.train()
    model = load(path)
    trainer = TrainStreamTrainer(model=model, args=targs(tmp_path / "cb", max_steps=3), train_dataset=TokenDataset(),
                                 callbacks=[cb], trainstream={"socket": tsd.socket})
    try:
        trainer.train()
        events = list(trainer.trainstream_session.events)
    finally:
        trainstream.unwrap(model)
    assert any("overlap_forward: off" in e and "ReadsWeights" in e for e in events)
    assert not any("finish during the next" in e for e in events)
    assert len(cb.seen) == 3 and all((a - b).abs().max() < 1e-5 for a, b in zip(cb.seen, ref_cb.seen))
    assert not torch.equal(cb.seen[0], cb.seen[1])  # each step's update, not a stale weight
    # Forced on (no evaluation, no save): the weights read right after train() have the last step's
    # updates (train() waits for them), bit for bit those of a run without overlap.
    after = {}
    for overlap in (True, False):
        model = load(path)
        t = TrainStreamTrainer(model=model, args=targs(tmp_path / f"forced{overlap}", max_steps=2, logging_steps=5),
                               train_dataset=TokenDataset(), trainstream={"socket": tsd.socket, "overlap_forward": overlap})
        try:
            t.train()
            after[overlap] = [p.detach().clone() for p in model.parameters()]
            events = list(t.trainstream_session.events)
        finally:
            trainstream.unwrap(model)
        assert any("finish during the next" in e for e in events) == overlap
    assert all(torch.equal(a, b) for a, b in zip(after[True], after[False]))


def test_torch_compile_with_overlap_equals_stock_compiled_trainer(tsd, tmp_path, checkpoints):
    """args.torch_compile=True with the default overlap_forward: the first step runs eagerly while
    the forward order is recorded, the compiled forwards wait for their updates (a graph break at
    each waiting module); losses and weights agree with the stock Trainer compiled the same way."""
    import torch._dynamo
    ref_model = load(checkpoints["llama"])
    model = copy.deepcopy(ref_model)
    torch._dynamo.reset()
    try:
        ref = Trainer(model=ref_model, args=targs(tmp_path / "ref", max_steps=4, torch_compile=True),
                      train_dataset=TokenDataset())
        ref.train()
        ts = run_ts(tsd, model, targs(tmp_path / "ts", max_steps=4, torch_compile=True))
    finally:
        torch._dynamo.reset()
    assert any("finish during the next forward" in e for e in ts.tsd_events)
    assert losses(ts) == pytest.approx(losses(ref), abs=2e-4) and len(losses(ts)) == 4
    assert max_diff(ref_model, model) < 1e-5
