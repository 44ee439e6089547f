"""Weight stores from Python (docs/stores.md): `Client.open_store` maps one read-only copy that tsd
built from the checkpoint files; a second job finds it without tsd reading tensor data; and
`load_model(..., store=...)` builds a model over it equal to the one read from the files."""
from __future__ import annotations

import os

import pytest
import torch

import trainstream
from trainstream import quant as Q

safetensors_torch = pytest.importorskip("safetensors.torch")


def _daemon_rchar(pid: int) -> int:
    """Bytes tsd has read through read()-like calls (files and sockets alike)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_two_jobs_map_one_store_read_only(tsd, tmp_path):
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    b = torch.randn(96).to(torch.bfloat16)
    path = str(tmp_path / "base.safetensors")
    safetensors_torch.save_file({"w": w, "b": b}, path)
    with trainstream.connect(socket=tsd.socket, job="store-a") as a, \
            trainstream.connect(socket=tsd.socket, job="store-b") as c:
        sa = a.open_store([path], "nf4", 64, [("w", True), ("b", False)])
        sb = c.open_store([path], "nf4", 64, [("w", True), ("b", False)])
        assert sa.built and not sb.built and sa.id == sb.id
        [info] = [s for s in a.stores() if s.id == sa.id]
        assert info.users == 2 and info.format == "nf4" and info.source == path
        codes, absmax = sb.quantized("w")
        ref_codes, ref_absmax = Q.quantize_tensor(w, "nf4", 64)
        assert torch.equal(codes, ref_codes.reshape(-1)) and torch.equal(absmax, ref_absmax.reshape(-1))
        assert torch.equal(sb.tensor("b"), b)
        assert sb.tensors["w"].shape == (64, 96) and sb.tensors["w"].quantized
        with pytest.raises(ValueError, match="stored quantized"):
            sb.tensor("w")
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            sb.tensor("nope")
        copy = sb.tensor("b", copy=True)
        copy.add_(1)  # a private copy: the store is untouched
        assert torch.equal(sb.tensor("b"), b)
        sa.close()
        assert [s.users for s in c.stores() if s.id == sa.id] == [1]


def test_a_bad_checkpoint_is_refused_naming_file_and_tensor(tsd, tmp_path):
    path = str(tmp_path / "ints.safetensors")
    safetensors_torch.save_file({"ids": torch.arange(8)}, path)
    with trainstream.connect(socket=tsd.socket, job="store-bad") as c:
        with pytest.raises(trainstream.InvalidRequest, match="tensor 'ids'.*I64"):
            c.open_store([path], "int8", 64, [("ids", True)])
        with pytest.raises(trainstream.TsdError, match="none of the 1 checkpoint"):
            c.open_store([path], "int8", 64, [("missing", True)])


transformers = pytest.importorskip("transformers")


def _saved(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = str(tmp_path / "llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def _logits(model):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    return model(ids).logits


def test_load_model_from_a_store_reads_the_checkpoint_once(tsd, tmp_path):
    from trainstream.integrations.huggingface import load_model
    d = _saved(tmp_path)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
    ref = load_model(d, quantize="nf4")
    with trainstream.connect(socket=tsd.socket, job="lm-a") as a, \
            trainstream.connect(socket=tsd.socket, job="lm-b") as b:
        before = _daemon_rchar(tsd.proc.pid)
        first = load_model(d, quantize="nf4", store=a)
        first_read = _daemon_rchar(tsd.proc.pid) - before
        before = _daemon_rchar(tsd.proc.pid)
        second = load_model(d, quantize="nf4", store=b)
        second_read = _daemon_rchar(tsd.proc.pid) - before
        assert first._ts_load_info["store_built"] and not second._ts_load_info["store_built"]
        assert first._ts_load_info["store"] == second._ts_load_info["store"]
        assert second._ts_load_info["bytes_read"] == 0
        assert first._ts_load_info["quantized_tensors"] == second._ts_load_info["quantized_tensors"] == 2 * 7
        assert first_read >= size, "tsd read the checkpoint to build the store"
        assert second_read < size // 10, f"the second load made tsd read {second_read} bytes"
        with torch.no_grad():
            expected = _logits(ref)
            assert torch.equal(_logits(first), expected)
            assert torch.equal(_logits(second), expected)
        # Training goes through the store's read-only weights: gradients flow, nothing is written.
        for p in second.parameters():
            p.requires_grad_(True)
        _logits(second).float().square().mean().backward()
        emb = second.get_input_embeddings().weight
        assert emb.grad is not None and torch.isfinite(emb.grad).all()
        with torch.no_grad():
            assert torch.equal(_logits(first), expected)


def test_two_processes_share_one_store_and_both_train_lora(tsd, tmp_path):
    """Two trainer processes load one checkpoint through tsd: the first builds the store, the
    second maps it without tsd or itself reading tensor data; both then train LoRA at the same
    time and get the losses of a run on the same model loaded from the files without a store."""
    import subprocess
    import sys

    from trainstream.integrations.huggingface import load_model
    d = _saved(tmp_path)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
    worker = os.path.join(os.path.dirname(__file__), "store_worker.py")
    env = dict(os.environ)
    import json

    def start(job):
        return subprocess.Popen([sys.executable, worker, tsd.socket, d, job, "4"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    procs, loaded, reads = [], [], []
    try:
        for job in ("share-a", "share-b"):
            before = _daemon_rchar(tsd.proc.pid)
            p = start(job)
            procs.append(p)
            line = p.stdout.readline()
            assert line, f"{job} ended before loading: {p.stderr.read()[-2000:]}"
            loaded.append(json.loads(line)["loaded"])
            reads.append(_daemon_rchar(tsd.proc.pid) - before)
        assert loaded[0]["store_built"] and not loaded[1]["store_built"]
        assert loaded[0]["store"] == loaded[1]["store"]
        assert loaded[0]["bytes_read"] > 0 and loaded[1]["bytes_read"] == 0  # the first counts what tsd read for it
        assert reads[0] >= size and reads[1] < size // 10, reads
        with trainstream.connect(socket=tsd.socket, job="share-watch") as c:
            assert [s.users for s in c.stores() if s.id == loaded[0]["store"]] == [2]
        for p in procs:  # both train at once
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.splitlines()[-1])["losses"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from store_worker import lora_losses
    finally:
        sys.path.pop(0)
    expected = lora_losses(load_model(d, quantize="nf4"), tsd.socket, "share-ref", 4)
    assert results[0] == results[1] == expected
    assert expected[-1] < expected[0]
