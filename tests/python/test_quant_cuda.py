"""trainstream.quant on a GPU (skipped without one, or with a libtsd_quant.so built without CUDA):
the CUDA dequantize equals the CPU kernels bit for bit, bitsandbytes' dequantize_4bit of tsd's NF4
buffers equals tsd's (when bitsandbytes is installed), QuantizedLinear on CUDA equals a Linear
holding the dequantized weight, and QLoRA through wrap() on CUDA equals stock peft LoRA."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainstream import quant as Q

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels():
    if not Q.has_cuda_kernels():
        pytest.skip("libtsd_quant.so was built without CUDA (configure with nvcc present)")


def values(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2
    if n >= 200:
        x[:64] = 0.0
        x[70] = -0.0
        x[130:133] = torch.tensor([1e-30, 60000.0, -60000.0])
    return x


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block", [(64 * 1000 + 37, 64), (4097, 128), (1 << 20, 64), (33, 2)])
def test_cuda_dequantize_equals_cpu(kind, dtype, n, block):
    codes, absmax = Q.quantize_tensor(values(n), kind, block)
    cpu = Q.dequantize_reference(codes, absmax, kind, block, n, dtype)
    gpu = Q.dequantize_reference(codes.cuda(), absmax.cuda(), kind, block, n, dtype)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bitsandbytes_dequantize_4bit_equals_tsd(dtype):
    bnb = pytest.importorskip("bitsandbytes")
    shape = (512, 384)
    w = values(shape[0] * shape[1], seed=3).view(shape)
    q = Q.QuantizedWeight.quantize(w, "nf4", 64, dtype=dtype).to("cuda")
    state = bnb.functional.QuantState(absmax=q.absmax, shape=torch.Size(shape), blocksize=64, quant_type="nf4",
                                      dtype=dtype, code=bnb.functional.get_4bit_type("nf4", device="cuda"))
    theirs = bnb.functional.dequantize_4bit(q.codes.view(-1, 1), quant_state=state)
    assert torch.equal(theirs.view(torch.uint8), q.dequantize().view(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_linear_on_cuda(kind, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 192, bias=True).to(dtype)
    ql = Q.QuantizedLinear.from_linear(lin, kind).cuda()
    assert Q.quantized_of(ql.weight).device.type == "cuda" and ql.weight.untyped_storage().nbytes() == 0
    plain = nn.Linear(256, 192, device="cuda", dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(Q.quantized_of(ql.weight).dequantize())
        plain.bias.copy_(lin.bias)
    plain.weight.requires_grad_(False)
    x = torch.randn(4, 8, 256, device="cuda", dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = ql(x), plain(x2)
    assert torch.equal(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad)


def test_no_dequantized_weight_is_held_between_layers_on_cuda():
    """A GPU keeps no workspace: after a forward the only new memory is the output (and at most
    what autograd saved), after backward only the input's gradient; the dequantized weights lived
    only during their matmuls. A kept 1024x4096 bf16 workspace would leave 8 MiB behind."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[Q.QuantizedLinear.from_linear(nn.Linear(1024, 4096, bias=False).to(torch.bfloat16),
                                                             "nf4").cuda(),
                             Q.QuantizedLinear.from_linear(nn.Linear(4096, 1024, bias=False).to(torch.bfloat16),
                                                           "nf4").cuda()])
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layers(x).float().sum().backward()  # once first: cuBLAS takes its own workspace on first use
    x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layers(x)
    saved = x.numel() * 2 + 2 * 4096 * 2  # each layer's input, kept for its backward
    assert torch.cuda.memory_allocated() - before <= saved + y.numel() * 2 + 4096
    y.float().sum().backward()
    del y
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == x.grad.numel() * 2
    assert Q.workspace_bytes("cuda") == 0


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qlora_through_wrap_on_cuda(tsd, tmp_path, kind):
    pytest.importorskip("peft")
    import pytest as _pytest
    from test_quant_qlora import run
    a, b, _ = run(tsd, tmp_path, kind, "cuda")
    assert a[-1] < a[0]
    assert b == _pytest.approx(a, abs=2e-4)


def test_generate_and_checkpointing_on_cuda(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_load_model import saved
    from trainstream.integrations.huggingface import load_model
    d = saved(tmp_path, dtype=torch.bfloat16)
    model = load_model(d, quantize="nf4").cuda()
    assert isinstance(model, transformers.PreTrainedModel)
    out = model.generate(torch.tensor([[1, 2, 3]], device="cuda"), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)
    model.gradient_checkpointing_enable()
    model.train()
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, 96, (2, 12), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
