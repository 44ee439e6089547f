"""QLoRA through trainstream.wrap(): a tiny Llama loaded with load_model(quantize=...), LoRA
adapters by peft, AdamW in tsd, equals a stock peft LoRA run (torch's AdamW) on a model holding
the dequantized base weights: losses within 2e-4 over 6 steps (CPU here; the CUDA variant is in
test_quant_cuda.py)."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import trainstream  # noqa: E402
from trainstream import quant as Q  # noqa: E402
from trainstream.integrations.huggingface import load_model  # noqa: E402
from hf_data import train_causal_lm  # noqa: E402

VOCAB = 96
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
            task_type="CAUSAL_LM")


def saved_llama(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = str(tmp_path / "ckpt")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def pair(d, kind, device):
    """(QLoRA model, reference peft model on the dequantized base) with equal adapters."""
    model = load_model(d, quantize=kind, dtype=torch.float32).to(device)
    ref_base = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    for name, p in model.named_parameters():
        qw = Q.quantized_of(p)
        if qw is not None:
            ref_base.get_parameter(name).data.copy_(qw.dequantize().cpu())
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref_base.to(device), peft.LoraConfig(**LORA))
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    ref_lora = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(ref_lora[n])
                # LoRA B starts at zero: make the adapters matter from step one
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator(device=p.device).manual_seed(hash(n) % 1000))
                    ref_lora[n].copy_(p)
    return model, ref


def run(tsd, tmp_path, kind, device):
    d = saved_llama(tmp_path)
    model, ref = pair(d, kind, device)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g).to(device)] * 6  # one batch: the loss must fall
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    a = train_causal_lm(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **hp), batches)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hp)
    model, opt = trainstream.wrap(model, opt, device=device, socket=tsd.socket)
    try:
        session = trainstream.unwrap_session(model)
        assert session is not None and len(session.params) == 3 * 3 * 2  # LoRA A and B of 3 modules x 3 layers
        b = train_causal_lm(model, opt, batches)
    finally:
        trainstream.unwrap(model)
    return a, b, model


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qlora_through_wrap_equals_peft_on_dequantized_base(tsd, tmp_path, kind):
    a, b, model = run(tsd, tmp_path, kind, "cpu")
    assert a[-1] < a[0]  # it learns
    assert b == pytest.approx(a, abs=2e-4)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(base, Q.QuantizedLinear) and Q.quantized_of(base.weight).kind == kind


def test_wrap_quantize_equals_load_model_quantize(tsd, tmp_path):
    """wrap(quantize="nf4") quantizes the frozen block weights of a full-precision peft model:
    the same run as a model loaded with load_model(quantize="nf4")."""
    d = saved_llama(tmp_path)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    runs = []
    for load_kind, wrap_kind in (("nf4", None), ("none", "nf4")):
        model = load_model(d, quantize=load_kind, dtype=torch.float32)
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, quantize=wrap_kind)
        try:
            q = model.base_model.model.model.layers[1].mlp.up_proj
            assert isinstance(q, Q.QuantizedLinear)
            assert all(Q.quantized_of(p) is None for p in model.parameters() if p.requires_grad)
            runs.append(train_causal_lm(model, opt, [ids] * 3))
        finally:
            trainstream.unwrap(model)
    assert runs[0] == runs[1]


def test_wrap_quantize_options_and_auto_choice(tsd):
    from trainstream.quant.auto import choose, weight_bytes
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters())
    for bad, match in ((dict(quantize="fp4"), "fp4"), (dict(prefer="fast"), "prefer"),
                       (dict(quantize="nf4", quant_block_size=63), "multiple of 2")):
        with pytest.raises(ValueError, match=match):
            trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, **bad)
    assert trainstream.unwrap_session(model) is None
    sizes = {"none": 1000, "int8": 600, "nf4": 400}
    assert choose(sizes, None) is None and choose(sizes, 1000) is None
    assert choose(sizes, 700) == "int8" and choose(sizes, 700, "speed") == "nf4"
    assert choose(sizes, 500) == "nf4" and choose(sizes, 100) == "nf4"
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    llama = LlamaForCausalLM(cfg)
    llama.requires_grad_(False)
    w = weight_bytes(llama, 64)
    block = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # q o, k v (2 of 4 heads), gate up down; 2 layers
    assert w["none"] - w["int8"] == block * 4 - block - 4 * (block // 64)
    assert w["none"] - w["nf4"] == block * 4 - block // 2 - 4 * (block // 64)
