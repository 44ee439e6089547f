"""TrainStreamTrainer launched as several processes (what torchrun or accelerate launch starts): the
ranks train data parallel through one tsd (wrap(distributed="auto")), against the stock Trainer,
whose accelerate wraps the model in DistributedDataParallel, on the CPU over gloo. Equal losses,
grad norms and parameters; one job with a session per rank and one optimizer; a checkpoint saved
by the first rank and a resumed run that continues bit-identically.

Each run starts its ranks as processes (tests/python/hf_dp_worker.py); a rank that hangs fails the
test by its timeout."""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import hf_data  # noqa: E402
import hf_dp_worker  # noqa: E402
from ranks import free_port, spawn_ranks  # noqa: E402
from trainstream.integrations.trainer import STATE_FILE  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")
WORLD = 2


def _run(mode: str, checkpoint: str, out_dir: str, sock: str, run: dict, resume=None, tag: str = "",
         timeout: float = 300) -> list[dict]:
    port = free_port()
    spawn_ranks(hf_dp_worker.main, lambda r: (r, WORLD, port, mode, checkpoint, out_dir, sock, run, resume, tag),
                WORLD, timeout)
    out = []
    for r in range(WORLD):
        res = torch.load(os.path.join(out_dir, f"{tag or mode}-rank{r}.pt"), weights_only=False)
        assert "exception" not in res, f"{mode} rank {r}: {res['exception']}"
        out.append(res)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (no dropout), saved once."""
    path = str(tmp_path_factory.mktemp("ckpt") / "llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=hf_data.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def test_two_processes_equal_stock_ddp(tsd, tmp_path, checkpoint):
    run = {"max_steps": 6, "save_strategy": "no"}
    stock = _run("stock", checkpoint, str(tmp_path), tsd.socket, run)
    mine = _run("tsd", checkpoint, str(tmp_path), tsd.socket, run)
    assert stock[0]["ddp"] == "DistributedDataParallel", "the reference must be accelerate's DDP"
    assert all(r["ddp"] != "DistributedDataParallel" for r in mine), "tsd reduces the gradients, not DDP"
    ref, got = stock[0], mine[0]
    assert len(got["losses"]) == 6
    assert got["losses"] == pytest.approx(ref["losses"], abs=2e-4)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    diff = _max_diff(got["params"], ref["params"])
    assert diff <= 1e-5, f"parameters differ from DDP + AdamW by {diff}"
    # Every rank holds the same parameters; one job with both ranks as sessions and one optimizer.
    assert _max_diff(mine[0]["params"], mine[1]["params"]) == 0.0
    for r in mine:
        assert r["world"] == WORLD == r["local_world"] == r["sessions"]
        assert r["used_bytes"] == r["state_bytes"], "the ranks share one optimizer state"
    assert mine[0]["job"] == mine[1]["job"]


def test_checkpoint_by_the_first_rank_and_resume_bit_identical(tsd, tmp_path, checkpoint):
    run = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3}
    full = _run("tsd", checkpoint, str(tmp_path), tsd.socket, run, tag="full")
    ckpt = os.path.join(tmp_path, "full", "checkpoint-3")
    assert os.path.isfile(os.path.join(ckpt, STATE_FILE)), "the first rank wrote tsd's state into the checkpoint"
    resumed = _run("tsd", checkpoint, str(tmp_path), tsd.socket, run, resume=ckpt, tag="resumed")
    # The resumed trainer's history starts with the checkpoint's (the first 3 steps).
    assert resumed[0]["losses"] == full[0]["losses"], "the resumed run continues bit-identically"
    assert resumed[0]["grad_norms"] == full[0]["grad_norms"]
    assert _max_diff(resumed[0]["params"], full[0]["params"]) == 0.0
    assert _max_diff(resumed[1]["params"], full[1]["params"]) == 0.0
