"""TrainStreamTrainer with weight paging (trainstream={"param_offload": ...}): a model passed on the
CPU is not moved to the device whole (neither by Trainer's _move_model_to_device nor by
accelerate's prepare); wrap() moves the resident blocks and pages the others, and the run trains
as the unpaged one does. The CUDA case skips without a GPU."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer  # noqa: E402

import trainstream  # noqa: E402
from test_hf_trainer import TokenDataset, load, losses, max_diff, targs  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402
from trainstream.integrations.trainer import wrap_places_model  # noqa: E402

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(root / "llama"))
    return str(root / "llama")


class Moves:
    """Records every model.to(...) / .cuda() call on a model (the whole model moved)."""

    def __init__(self, model):
        self.calls = []
        to, cuda = model.to, model.cuda

        def rec_to(*a, **kw):
            self.calls.append(("to", a, kw))
            return to(*a, **kw)

        def rec_cuda(*a, **kw):
            self.calls.append(("cuda", a, kw))
            return cuda(*a, **kw)
        model.to, model.cuda = rec_to, rec_cuda


def run(tsd, model, args, **options):
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=TokenDataset(),
                                 trainstream={"socket": tsd.socket, **options})
    try:
        trainer.train()
        s = trainer.trainstream_session
        trainer.paged = set(s.pager.paged) if s.pager is not None else set()
        trainer.tsd_events = list(s.events)
    finally:
        if trainstream.unwrap_session(model) is not None:
            trainstream.unwrap(model)
    return trainer


def test_a_cpu_model_with_paging_is_not_moved_and_trains_as_unpaged(tsd, tmp_path, llama):
    """param_offload=True: Trainer and accelerate never move the model (the pager places it);
    losses and weights equal the unpaged TrainStreamTrainer's bit for bit, which equal the stock
    Trainer's within 2e-4."""
    ref_model = load(llama)
    plain_model, paged_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    ref = Trainer(model=ref_model, args=targs(tmp_path / "ref"), train_dataset=TokenDataset())
    ref.train()
    plain = run(tsd, plain_model, targs(tmp_path / "plain"))
    assert losses(plain) == pytest.approx(losses(ref), abs=2e-4)

    moves = Moves(paged_model)
    trainer = TrainStreamTrainer(model=paged_model, args=targs(tmp_path / "paged"), train_dataset=TokenDataset(),
                                 trainstream={"socket": tsd.socket, "param_offload": True})
    assert moves.calls == [], "Trainer moved a model whose blocks are to be paged"
    assert trainer.accelerator.device_placement is False
    try:
        trainer.train()
        s = trainer.trainstream_session
        assert s.pager is not None and s.pager.paged == {0, 1, 2}
        assert moves.calls == [], f"the model was moved whole: {moves.calls}"
        assert any("param_offload=True" in e and "paged from tsd's memory" in e for e in s.events)
    finally:
        trainstream.unwrap(paged_model)
    assert losses(trainer) == losses(plain), "paging changed the losses"
    assert max_diff(plain_model, paged_model) == 0.0


@pytest.mark.parametrize("options", [{}, {"param_offload": False}])
def test_without_paging_the_trainer_places_the_model_as_stock(tsd, tmp_path, llama, options):
    """param_offload at its default ("auto") on a model that fits, or off: Trainer moves the
    model as it always does."""
    model = load(llama)
    moves = Moves(model)
    trainer = TrainStreamTrainer(model=model, args=targs(tmp_path, max_steps=1), train_dataset=TokenDataset(),
                                 trainstream={"socket": tsd.socket, **options})
    assert moves.calls and moves.calls[0][0] == "to"
    assert trainer.accelerator.device_placement is True


def test_wrap_places_the_model_for_explicit_paging_or_weights_too_big_for_the_gpu(llama):
    """Who places the model: wrap() for an explicit param_offload choice; with "auto" only when
    the weights not on the GPU would not fit there whole (a 2 TB model on the meta device: on a
    machine with a GPU), else Trainer, as stock."""
    model = load(llama)
    assert not wrap_places_model(False, model) and not wrap_places_model(None, model)
    assert wrap_places_model(True, model) and wrap_places_model(0.5, model) and wrap_places_model([0, 2], model)
    assert not wrap_places_model("auto", model)  # 0.4 MB: fits any GPU (and without one there is none to fill)
    with torch.device("meta"):
        huge = torch.nn.ModuleList(torch.nn.Linear(1 << 16, 1 << 16) for _ in range(128))  # 2.2 TB of fp32
    assert wrap_places_model("auto", huge) is torch.cuda.is_available()


@NO_CUDA
def test_cuda_a_cpu_model_is_paged_by_the_trainer_without_moving_it_whole(tsd, tmp_path, llama):
    """On the GPU: the model passed on the CPU stays there while the trainer is built (nothing
    allocated on the device); training pages blocks 0 and 2 and moves the rest; losses and
    weights equal the unpaged TrainStreamTrainer's (moved to the GPU by Trainer) bit for bit."""
    base = load(llama)
    plain_model, paged_model = copy.deepcopy(base), copy.deepcopy(base)
    plain = run(tsd, plain_model, targs(tmp_path / "plain", "cuda"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moves = Moves(paged_model)
    trainer = TrainStreamTrainer(model=paged_model, args=targs(tmp_path / "paged", "cuda"), train_dataset=TokenDataset(),
                                 trainstream={"socket": tsd.socket, "param_offload": [0, 2]})
    size = sum(p.numel() * p.element_size() for p in paged_model.parameters())
    assert torch.cuda.memory_allocated() - before < size, "building the trainer moved the model to the GPU"
    assert all(p.device.type == "cpu" for p in paged_model.parameters())
    try:
        trainer.train()
        s = trainer.trainstream_session
        assert s.pager.paged == {0, 2}
        layers = paged_model.model.layers
        assert all(p.untyped_storage().nbytes() == 0 for p in layers[0].parameters())
        assert all(p.device.type == "cuda" and p.untyped_storage().nbytes() > 0 for p in layers[1].parameters())
        assert len(moves.calls) <= 1, moves.calls  # wrap()'s own move of what is not paged, once paging started
        assert s.pager.last_step_h2d_bytes == s.pager.h2d_bytes_per_step
    finally:
        trainstream.unwrap(paged_model)
    assert losses(trainer) == losses(plain)
    assert max_diff(plain_model, paged_model) == 0.0


def test_a_checkpoint_resumes_with_other_blocks_paged(tsd, tmp_path, llama):
    """The checkpoint's layout counts a paged parameter by its shape (between uses it is an empty
    tensor), so a run paging other blocks, or none, resumes from it; paging changes nothing, so
    steps 4-6 and the final weights are the uninterrupted run's bit for bit."""
    import json

    from test_hf_trainer import run_ts
    from trainstream.integrations.trainer import STATE_META_FILE

    whole = load(llama)
    a = run_ts(tsd, whole, targs(tmp_path / "a", save_strategy="steps", save_steps=3), param_offload=[0])
    ckpt = tmp_path / "a" / "checkpoint-3"
    sizes = {n: k for n, k in json.loads((ckpt / STATE_META_FILE).read_text())["buckets"]}
    assert sizes["model.layers.0.mlp.up_proj.weight"] == 64 * 128  # paged when saved
    for paged in ([2], False):
        resumed = load(llama)
        b = run_ts(tsd, resumed, targs(tmp_path / f"b{paged}"), resume=str(ckpt), param_offload=paged)
        assert losses(b) == losses(a), paged
        assert max_diff(whole, resumed) == 0.0, paged


def test_a_layout_from_before_paged_sizes_were_counted_still_matches():
    """Checkpoints written before held 0 for the parameters paged when they were saved: such an
    entry matches by name (tsd checks the file's sizes against its buckets when it loads)."""
    from trainstream.integrations.trainer import _same_layout

    mine = [["a", 8], ["b", 4]]
    assert _same_layout([["a", 8], ["b", 4]], mine) and _same_layout([("a", 0), ("b", 4)], mine)
    assert not _same_layout([["a", 8], ["b", 5]], mine) and not _same_layout([["a", 8], ["c", 4]], mine)
    assert not _same_layout([["a", 8]], mine)
