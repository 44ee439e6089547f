"""trainstream.quant: quantize_tensor / dequantize_reference (the C++ kernels) against the NumPy
reference, QuantizedWeight, QuantizedLinear (forward/backward equal a plain Linear holding the
dequantized weight), quantize_model, and peft LoRA on a quantized model (CPU)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import quant_reference as ref
import trainstream
from trainstream import quant as Q

KINDS = ("int8", "nf4")


def edge_tensor(n: int, block: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    x[: block] = 0.0                       # a whole zero block
    x[101] = -0.0                          # negative zero
    x[102] = -x[96:128].abs().max()        # a value equal to minus the block's absmax
    x[200:205] = torch.tensor([1e-30, -1e-30, 65000.0, -65000.0, 0.5])
    return x.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [64, 32, 2])
def test_quantize_tensor_matches_reference(kind, dtype, block):
    x = edge_tensor(7 * 64 + 13, block, dtype)  # a last partial block, an odd count
    codes, absmax = Q.quantize_tensor(x.view(-1, 1), kind, block)
    want_codes, want_absmax = ref.quantize(x, kind, block)
    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32
    assert np.array_equal(codes.numpy(), want_codes) and np.array_equal(absmax.numpy(), want_absmax)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        got = Q.dequantize_reference(codes, absmax, kind, block, x.numel(), out)
        want = ref.dequantize(want_codes, want_absmax, kind, block, x.numel(), out)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), out


def test_bad_inputs_are_refused_clearly():
    x = torch.randn(128)
    with pytest.raises(ValueError, match="unknown quantization kind 'fp4'"):
        Q.quantize_tensor(x, "fp4")
    with pytest.raises(ValueError, match="multiple of 2"):
        Q.quantize_tensor(x, "nf4", 63)
    for bad in (0, -64, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            Q.quantize_tensor(x, "int8", bad)
    for v in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[77] = v
        with pytest.raises(ValueError, match="finite"):
            Q.quantize_tensor(y, "nf4")
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        Q.quantize_tensor(x.double(), "int8")
    codes, absmax = Q.quantize_tensor(x, "int8")
    with pytest.raises(ValueError, match="need"):
        Q.dequantize_reference(codes[:10], absmax, "int8", 64, 128, torch.float32)


def test_quantize_in_ranges_on_threads_gives_the_single_calls_bits(monkeypatch):
    """quantize_tensor splits a large tensor into whole-block ranges quantized on threads: the codes
    and absmax are those of one call over the whole tensor (a last partial block and an odd
    element count included), and an error still names the element in the whole tensor."""
    from trainstream.quant import formats

    x = torch.randn(10 * 4096 + 37, dtype=torch.bfloat16)
    x[5000:5064] = 0  # a whole zero block inside a range
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 1 << 30)
    want = {k: Q.quantize_tensor(x, k, 64) for k in ("nf4", "int8")}
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 4096)  # 11 ranges
    monkeypatch.setattr(formats, "_quantize_threads", lambda: 4)
    for kind, (codes, absmax) in want.items():
        got_codes, got_absmax = Q.quantize_tensor(x, kind, 64)
        assert torch.equal(got_codes, codes) and torch.equal(got_absmax, absmax), kind
    y = x.clone()
    y[9 * 4096 + 130] = float("nan")
    with pytest.raises(ValueError, match=rf"element {9 * 4096 + 130} \(block {(9 * 4096 + 130) // 64}\) of the input is NaN"):
        Q.quantize_tensor(y, "nf4", 64)


def test_quantized_weight_and_parameter():
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    q = Q.QuantizedWeight.quantize(w, "nf4", 64)
    assert q.kind == "nf4" and q.block_size == 64 and q.shape == w.shape and q.dtype == torch.bfloat16
    codes, absmax = Q.quantize_tensor(w, "nf4", 64)
    want = Q.dequantize_reference(codes, absmax, "nf4", 64, w.numel(), torch.bfloat16).view(w.shape)
    assert torch.equal(q.dequantize(), want)
    assert torch.equal(q.dequantize(torch.float32), Q.dequantize_reference(codes, absmax, "nf4", 64, w.numel()).view(w.shape))
    out = torch.empty(w.numel(), dtype=torch.float16)
    assert q.dequantize(out=out).data_ptr() == out.data_ptr()
    p = Q.QuantizedParameter.of(q)
    assert p.shape == w.shape and p.untyped_storage().nbytes() == 0 and not p.requires_grad
    assert Q.quantized_of(p) is q and Q.quantized_of(nn.Parameter(w)) is None
    assert torch.equal(p.data, want) and torch.equal(p + 0, want)  # reading it dequantizes (no crash)
    assert "nf4" in repr(p)


def _layer(bias: bool, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(96, 80, bias=bias).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_linear_on_dequantized_weight(kind, bias):
    lin = _layer(bias)
    ql = Q.QuantizedLinear.from_linear(lin, kind)
    assert isinstance(ql, nn.Linear) and ql.weight.untyped_storage().nbytes() == 0
    plain = nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        plain.weight.copy_(Q.quantized_of(ql.weight).dequantize())
        if bias:
            plain.bias.copy_(lin.bias)
    plain.weight.requires_grad_(False)
    x = torch.randn(3, 5, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = ql(x), plain(x2)
    assert torch.equal(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad)
    assert ql.weight.grad is None
    if bias:
        torch.testing.assert_close(ql.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_linear_low_precision_and_autocast(dtype):
    lin = _layer(True, dtype)
    ql = Q.QuantizedLinear.from_linear(lin, "nf4")
    x = torch.randn(4, 96, dtype=dtype)
    w = Q.quantized_of(ql.weight).dequantize()
    assert w.dtype == dtype
    assert torch.equal(ql(x), nn.functional.linear(x, w, lin.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ql.float()(x.float())
    assert y.dtype == torch.bfloat16
    assert Q.quantized_of(ql.weight).dtype == torch.float32  # .float() changed the compute dtype


def test_workspace_is_shared_and_reused():
    layers = [Q.QuantizedLinear.from_linear(nn.Linear(64, 64), "int8") for _ in range(3)]
    x = torch.randn(2, 64)
    for m in layers:
        x = m(x)
    before = Q.workspace_bytes()
    assert Q.workspace_bytes("cpu") == before >= 64 * 64 * 4  # the CPU keeps one, of the largest layer
    for m in layers:
        m(torch.randn(2, 64)).sum()
    assert Q.workspace_bytes() == before


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.layers:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.training else b(x)
        return self.head(x)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_model_quantizes_only_block_linears(kind):
    torch.manual_seed(0)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainstream.quantize_model(model, kind)
    quantized = {n for n, p in model.named_parameters() if Q.quantized_of(p) is not None}
    assert quantized == {f"layers.{i}.{m}.weight" for i in range(3) for m in ("up", "down")}
    for n, p in model.named_parameters():
        if n not in quantized:
            assert torch.equal(p, before[n]), n
        else:
            c, a = Q.quantize_tensor(before[n], kind, 64)
            assert torch.equal(Q.quantized_of(p).dequantize(),
                               Q.dequantize_reference(c, a, kind, 64, p.numel(), torch.float32).view(p.shape))


def test_quantize_model_skips_trained_weights_and_refuses_bad_input():
    model = Tiny()
    for p in model.parameters():
        p.requires_grad_(False)
    model.layers[0].up.weight.requires_grad_(True)  # trained: stays full precision
    with pytest.raises(ValueError, match="unknown quantization kind"):
        trainstream.quantize_model(model, "fp4")
    with torch.no_grad():
        model.layers[2].down.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layers|finite"):
        trainstream.quantize_model(model, "nf4")
    assert not any(isinstance(m, Q.QuantizedLinear) for m in model.modules())  # nothing changed
    with torch.no_grad():
        model.layers[2].down.weight[0, 0] = 0.0
    trainstream.quantize_model(model, "nf4")
    assert type(model.layers[0].up) is nn.Linear and isinstance(model.layers[0].down, Q.QuantizedLinear)


def test_checkpointing_eval_and_training_through_quantized_layers():
    torch.manual_seed(0)
    model = Tiny()
    trainstream.quantize_model(model, "nf4")
    ids = torch.randint(0, 50, (2, 7))
    model.train()
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    assert model.embed.weight.grad is not None and model.layers[0].up.bias.grad is not None
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()


def test_state_dict_holds_codes_not_full_weights():
    model = Tiny()
    trainstream.quantize_model(model, "nf4")
    sd = model.state_dict()
    w = sd["layers.0.up.weight"]
    assert w.dtype == torch.uint8 and w.numel() == 64 * 32 // 2
    assert "layers.0.up.weight.absmax" in sd and "layers.0.up.weight.quant_state.bitsandbytes__nf4" in sd


@pytest.mark.parametrize("kind", KINDS)
def test_peft_lora_on_quantized_model_trains_and_merges(kind):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = Tiny()
    trainstream.quantize_model(model, kind)
    deq = {n: Q.quantized_of(p).dequantize().clone() for n, p in model.named_parameters()
           if Q.quantized_of(p) is not None}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"],
                                                    init_lora_weights=False))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 50, (2, 9))
    losses = []
    for _ in range(4):
        loss = pm(ids).float().logsumexp(-1).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] != losses[0]
    with torch.no_grad():
        before = pm(ids)
    layer = pm.base_model.model.layers[1].up
    delta = layer.get_delta_weight("default").detach().clone()
    merged = pm.merge_and_unload()
    up = merged.layers[1].up
    assert isinstance(up, nn.Linear) and Q.quantized_of(up.weight) is None
    assert up.weight.untyped_storage().nbytes() == up.weight.numel() * 4
    assert torch.equal(up.weight, deq["layers.1.up.weight"] + delta)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_round_trip_and_from_full_precision(kind):
    torch.manual_seed(0)
    src = Tiny()
    full_sd = {k: v.clone() for k, v in src.state_dict().items()}
    trainstream.quantize_model(src, kind)
    dst = Tiny()
    trainstream.quantize_model(dst, kind)
    dst.load_state_dict(src.state_dict())  # strict: every key placed, codes kept as they are
    for n, p in src.named_parameters():
        a, b = Q.quantized_of(p), Q.quantized_of(dst.get_parameter(n))
        if a is None:
            assert torch.equal(p, dst.get_parameter(n)), n
        else:
            assert torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax) and b.kind == kind, n
    other = Tiny()
    trainstream.quantize_model(other, kind)
    other.load_state_dict(full_sd)  # full-precision weights: quantized as the layer's format
    q = Q.quantized_of(other.layers[1].up.weight)
    assert torch.equal(q.codes, Q.quantized_of(src.layers[1].up.weight).codes)
    bad = dict(full_sd, **{"layers.0.up.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match="does not fit"):
        other.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({k: v for k, v in full_sd.items() if k != "layers.2.down.weight"})
