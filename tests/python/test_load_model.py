"""trainstream.integrations.huggingface.load_model on tiny Llama and Qwen2 checkpoints saved by the
tests themselves (no hub): equal to from_pretrained, quantized while read, "auto" by budget,
random weights with overrides, pre-quantized (bitsandbytes-layout) checkpoints, bad inputs."""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

from trainstream import quant as Q  # noqa: E402
from trainstream.integrations.huggingface import load_model  # noqa: E402

VOCAB = 96


def saved(tmp_path, arch="llama", tie=False, dtype=torch.float32, shard=None):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    d = str(tmp_path / f"{arch}-{tie}-{str(dtype)[6:]}-{shard}")
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    return d


def logits(model, seed=1):
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch,tie,dtype,shard", [("llama", False, torch.bfloat16, None),
                                                  ("llama", True, torch.float32, "100KB"),
                                                  ("qwen2", False, torch.float32, None),
                                                  ("qwen2", True, torch.bfloat16, "100KB")])
def test_none_equals_from_pretrained(tmp_path, arch, tie, dtype, shard):
    d = saved(tmp_path, arch, tie, dtype, shard)
    if shard:
        assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    model = load_model(d, quantize="none", dtype=dtype)
    assert model._ts_load_info["quantize"] is None and model._ts_load_info["quantized_tensors"] == 0
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert not model.training
    assert torch.equal(logits(ref), logits(model))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantizes_while_reading(tmp_path, arch, kind):
    d = saved(tmp_path, arch, dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    model = load_model(d, quantize=kind)
    assert model._ts_load_info["quantized_tensors"] == 3 * 7  # q k v o gate up down per layer
    for name, p in model.named_parameters():
        qw = Q.quantized_of(p)
        if qw is None:
            assert torch.equal(p, ref.get_parameter(name)), name
            assert "layers" not in name or not name.endswith("proj.weight"), name
            continue
        assert p.untyped_storage().nbytes() == 0 and not p.requires_grad and qw.kind == kind
        q, a = Q.quantize_tensor(ref.get_parameter(name), kind, 64)
        want = Q.dequantize_reference(q, a, kind, 64, p.numel(), torch.bfloat16).view(p.shape)
        assert torch.equal(qw.dequantize(), want), name
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_auto_picks_the_most_precise_format_that_fits(tmp_path):
    d = saved(tmp_path, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(d).parameters())
    for factor, want in ((1.01, None), (0.75, "int8"), (0.5, "nf4")):  # budget as a multiple of the bf16 bytes
        model = load_model(d, budget_bytes=int(factor * 2 * numel))
        assert model._ts_load_info["quantize"] == want, factor
    from trainstream.planner import Budget
    assert load_model(d, budget=Budget(ram_available=int(1.5 * numel), processes=1))._ts_load_info["quantize"] == "int8"
    with pytest.raises(ValueError, match="even as NF4"):
        load_model(d, budget_bytes=1000)


def test_random_weights_and_overrides(tmp_path):
    d = saved(tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))  # reads no weights at all
    model = load_model(d, random_weights=True, quantize="nf4", num_hidden_layers=2)
    assert len(model.model.layers) == 2 and model._ts_load_info["quantized_tensors"] == 2 * 7
    assert model._ts_load_info["bytes_read"] == 0
    assert torch.isfinite(logits(model)).all()
    with pytest.raises(ValueError, match="not fields"):
        load_model(d, random_weights=True, no_such_field=3)


def test_overrides_skip_tensors_of_dropped_layers(tmp_path):
    d = saved(tmp_path)
    model = load_model(d, quantize="int8", num_hidden_layers=1)
    ref = AutoModelForCausalLM.from_pretrained(d)
    assert len(model.model.layers) == 1
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_prequantized_checkpoint_is_read_without_requantizing(tmp_path):
    d = saved(tmp_path, dtype=torch.bfloat16)
    model = load_model(d, quantize="nf4")
    out = str(tmp_path / "nf4")
    model.save_pretrained(out)  # the bitsandbytes layout: weight (uint8), weight.absmax, quant_state
    again = load_model(out, quantize="nf4")
    assert again._ts_load_info["prequantized_tensors"] == 3 * 7 and again._ts_load_info["quantized_tensors"] == 0
    for name, p in model.named_parameters():
        q1, q2 = Q.quantized_of(p), Q.quantized_of(again.get_parameter(name))
        if q1 is not None:
            assert torch.equal(q1.codes, q2.codes) and torch.equal(q1.absmax, q2.absmax), name
    assert torch.equal(logits(model), logits(again))
    assert load_model(out, budget_bytes=1 << 40)._ts_load_info["prequantized_tensors"] == 3 * 7  # auto keeps it
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16"}
    json.dump(cfg, open(cfg_path, "w"))
    assert torch.equal(logits(model), logits(load_model(out)))  # as bitsandbytes' "bnb-4bit" configs say it
    for bad in ({"bnb_4bit_use_double_quant": True}, {"bnb_4bit_quant_type": "fp4"}, {"quant_method": "gptq"}):
        json.dump(dict(cfg, quantization_config=dict(cfg["quantization_config"], **bad)), open(cfg_path, "w"))
        with pytest.raises(ValueError, match="NF4 without double"):
            load_model(out)
    json.dump(cfg, open(cfg_path, "w"))
    full = load_model(out, quantize="none")
    assert Q.quantized_of(full.model.layers[0].self_attn.q_proj.weight) is None
    assert torch.equal(full.model.layers[0].self_attn.q_proj.weight,
                       Q.quantized_of(model.model.layers[0].self_attn.q_proj.weight).dequantize())


def test_bad_inputs(tmp_path):
    d = saved(tmp_path)
    with pytest.raises(ValueError, match="fp4"):
        load_model(d, quantize="fp4")
    with pytest.raises(ValueError, match="multiple of 2"):
        load_model(d, quantize="nf4", block_size=63)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(d, "config.json")).read())
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_model(str(empty))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nowhere"))
    # a truncated shard: named in the error
    shard = os.path.join(d, "model.safetensors")
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(d, quantize="int8")
    # tensors that do not match the config
    d2 = saved(tmp_path / "b")
    cfg = json.load(open(os.path.join(d2, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(d2, "config.json"), "w"))
    with pytest.raises(ValueError, match="do not match"):
        load_model(d2, quantize="none")
    cfg["intermediate_size"] = 128
    cfg["num_hidden_layers"] = 4
    json.dump(cfg, open(os.path.join(d2, "config.json"), "w"))
    with pytest.raises(ValueError, match="do not match"):
        load_model(d2, quantize="none")


def test_quantized_weights_in_tsd_memory(tsd, tmp_path):
    import trainstream
    from trainstream.memory import HostArena
    d = saved(tmp_path, dtype=torch.bfloat16)
    ref = load_model(d, quantize="nf4")
    with trainstream.connect(socket=tsd.socket, job="quant-load", quota="64MiB") as c:
        arena = HostArena(c, purpose="quantized weights", chunk_bytes=1 << 20)
        model = load_model(d, quantize="nf4", host=arena)
        assert model._ts_load_info["host"] == "tsd"
        qs = [Q.quantized_of(p) for p in model.parameters() if Q.quantized_of(p) is not None]
        assert len(qs) == 3 * 7 and all(q.host_block is not None for q in qs)
        assert arena.in_use_bytes >= sum(q.nbytes for q in qs) and c.status() is not None
        assert torch.equal(logits(model), logits(ref))
        del model, qs
        import gc
        gc.collect()
        arena.reclaim()
        assert arena.in_use_bytes == 0  # the blocks went back with the weights
        arena.close()


def test_cast_on_load_checkpointing_and_kbit_preparation(tmp_path):
    d = saved(tmp_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert torch.equal(logits(ref), logits(load_model(d, quantize="none", dtype=torch.bfloat16)))
    model = load_model(d, quantize="nf4", dtype=torch.bfloat16)
    peft = pytest.importorskip("peft")
    model = peft.prepare_model_for_kbit_training(model)  # casts bf16 parameters' .data to fp32
    q = Q.quantized_of(model.model.layers[0].mlp.up_proj.weight)
    assert q is not None and q.dtype == torch.float32 and model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.untyped_storage().nbytes() == 0
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    assert model.base_model.model.is_gradient_checkpointing
    ids = torch.randint(0, VOCAB, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_progress_shows_tensors_and_bytes(tmp_path, capsys):
    d = saved(tmp_path)
    load_model(d, quantize="int8", progress=True)
    err = capsys.readouterr().err
    assert "load_model: 30/30 tensors" in err and "KiB" in err
    load_model(d, quantize="int8")  # not a terminal: silent
    assert "load_model:" not in capsys.readouterr().err


def test_quantized_weights_go_to_tsd_by_default_when_one_answers(tsd, tmp_path, monkeypatch):
    """host="auto" (the default): a tsd at the default socket gets the quantized weights (a job of
    the load's own, alive as long as the model); without one they stay in process memory and the
    load says why."""
    import gc

    import trainstream
    d = saved(tmp_path, dtype=torch.bfloat16)
    monkeypatch.setenv("TSD_SOCKET", str(tmp_path / "nobody.sock"))
    alone = load_model(d, quantize="nf4")
    assert alone._ts_load_info["host"] == "process" and "no tsd answered" in alone._ts_load_info["host_note"]
    monkeypatch.setenv("TSD_SOCKET", tsd.socket)
    model = load_model(d, quantize="nf4")
    assert model._ts_load_info["host"] == "tsd" and "host_note" not in model._ts_load_info
    qs = [Q.quantized_of(p) for p in model.parameters() if Q.quantized_of(p) is not None]
    assert qs and all(q.host_block is not None for q in qs)
    assert torch.equal(logits(model), logits(alone))
    job = f"load-model-{os.getpid()}"
    with trainstream.connect(socket=tsd.socket) as c:
        [held] = [j.used_bytes for j in c.jobs() if j.name == job]
        assert held >= sum(q.nbytes for q in qs)
        del model, qs
        gc.collect()
        assert not [j for j in c.jobs() if j.name == job]  # the model went, and its session with it
    # Not quantized: nothing to keep in tsd, no session.
    plain = load_model(d, quantize="none")
    assert plain._ts_load_info["host"] == "process" and not hasattr(plain, "_ts_host")
