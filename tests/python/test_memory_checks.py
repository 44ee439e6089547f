"""wrap(check_memory=True): what is certain not to fit is refused before anything is allocated
(the optimizer's state against tsd's pool and the job's quota, the resident weights against the
usable and free VRAM, tsd's regions and the client's own host needs against the node's RAM);
moment_dtype="auto" follows the pool, the quota and the RAM; activation_offload="auto" profiles the
first step and pages what the VRAM budget needs. The seed's planner tests, adapted to tsd and
runnable on a CPU; the CUDA variants skip without a GPU."""
import copy
import dataclasses
import gc

import pytest
import torch
from torch import nn

import trainstream
import trainstream.planner as planner
from gpt import batches, make_gpt, param_groups, train
from trainstream.client import OptimizerLayout
from trainstream.paging.activations import ActivationProfiler
from trainstream.planner import Budget, Demand

MiB = 1 << 20
GiB = 1 << 30
HP = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")


def layout(total):
    return OptimizerLayout(state_bytes=total, control_bytes=4096, master_bytes=total // 2, moment_bytes=total // 8,
                           grad_bytes=total // 8, param_bytes=total // 8 - 4096, accum_bytes=0, buckets=((0, 0, 0),))


OPT = {"float32": layout(200 * MiB), "bfloat16": layout(160 * MiB)}


def budget(**kw):
    base = dict(quota=GiB, job_used=0, pool_free=GiB, pool_total=GiB)
    base.update(kw)
    return Budget(**base)


def demand(**kw):
    return Demand(parameters=10_000_000, optimizer=OPT, **kw)


# --------------------------------------------------------------------------- the pure checks
def test_host_ram_counts_tsd_regions_and_the_clients_own_needs():
    d = demand(host_parts=(("streaming buffer", 64 * MiB),))
    assert d.host_bytes("float32") == 264 * MiB and d.host_bytes("bfloat16") == 224 * MiB
    room = int(250 * MiB / planner.RAM_HEADROOM) + 1  # 250 MiB this process may take
    p = planner.plan(budget(ram_available=room), d)
    assert p.moment_dtype == "bfloat16" and p.host_bytes == 224 * MiB  # fp32 would not fit the RAM
    with pytest.raises(trainstream.MemoryCheckFailed) as e:
        planner.plan(budget(ram_available=room), d, moment_dtype="float32")
    msg = str(e.value)
    for part in ("host RAM", "needs 264.00 MiB", "tsd's regions for the job 200.00 MiB", "streaming buffer 64.00 MiB",
                 "moment_dtype='bfloat16' (needs 224.00 MiB)", "check_memory=False"):
        assert part in msg, part
    assert [r.what for r in e.value.refusals] == ["host"]
    assert isinstance(e.value, MemoryError) and isinstance(e.value, trainstream.QuotaExceeded)
    # Training processes of one node share its RAM.
    with pytest.raises(trainstream.MemoryCheckFailed, match="shared by 2 training processes"):
        planner.plan(budget(ram_available=int(400 * MiB / planner.RAM_HEADROOM), processes=2), d)
    assert planner.plan(budget(ram_available=room), d, moment_dtype="float32", check_memory=False).host_bytes \
        == 264 * MiB


def test_bf16_advice_only_when_not_already_assumed():
    d = demand()
    with pytest.raises(trainstream.MemoryCheckFailed) as e:  # auto already chose bf16: no such advice
        planner.plan(budget(ram_available=100 * MiB), d)
    assert "moment_dtype='bfloat16'" not in str(e.value) and "(bfloat16 moments)" in str(e.value)
    with pytest.raises(trainstream.MemoryCheckFailed) as e:
        planner.plan(budget(ram_available=100 * MiB), d, moment_dtype="float32")
    assert "moment_dtype='bfloat16'" in str(e.value)


def test_every_failing_part_is_named_at_once():
    d = demand(device="cuda:0", weights_on_device=3 * GiB, largest_grad=GiB // 2, frozen_weights=2 * GiB)
    with pytest.raises(trainstream.MemoryCheckFailed) as e:
        planner.plan(budget(quota=100 * MiB, ram_available=100 * MiB, vram_usable=2 * GiB, vram_free=GiB), d,
                     moment_dtype="float32")
    err = e.value
    assert [r.what for r in err.refusals] == ["tsd", "vram_usable", "host"]
    msg = str(err)
    assert "(1) tsd cannot hold" in msg and "(2) the model's weights do not fit in cuda:0's usable VRAM" in msg
    assert "(3) the node's host RAM" in msg
    assert "larger quota=" in msg and "param_offload='auto'" in msg and "quantize='int8' or 'nf4'" in msg
    assert "resident weights 3.00 GiB" in msg and "of 2.00 GiB usable" in msg
    vram = err.refusals[1]
    assert (vram.needed, vram.available) == (3 * GiB + GiB // 2, 2 * GiB)
    # An already quantized base gets no advice to quantize it.
    with pytest.raises(trainstream.MemoryCheckFailed) as e:
        planner.plan(budget(vram_usable=2 * GiB), dataclasses.replace(d, quantized="nf4"))
    assert "quantize=" not in str(e.value) and "param_offload='auto'" in str(e.value)


def test_paged_weights_leave_vram_and_count_in_tsd():
    """The weight pager's split: paged weights are not resident; frozen ones take a region of
    their own in tsd (and host RAM); the blocks in flight take VRAM."""
    d = demand(device="cuda:0", weights_on_device=GiB, largest_grad=100 * MiB, weights_paged=4 * GiB,
               paged_region_bytes=3 * GiB, paged_inflight=200 * MiB)
    assert d.vram_resident == GiB + 300 * MiB
    assert d.tsd_bytes("bfloat16") == 160 * MiB + 3 * GiB
    assert planner.plan(budget(quota=4 * GiB, pool_free=4 * GiB, vram_usable=2 * GiB), d).moment_dtype == "float32"
    with pytest.raises(trainstream.MemoryCheckFailed, match="paged frozen weights 3.00 GiB"):
        planner.plan(budget(quota=3 * GiB, pool_free=4 * GiB), d)
    with pytest.raises(trainstream.MemoryCheckFailed, match="4.00 GiB of weights paged"):
        planner.plan(budget(quota=4 * GiB, pool_free=4 * GiB, vram_usable=GiB), d)
    with pytest.raises(ValueError, match="paged_inflight"):
        demand(paged_inflight=-1)
    with pytest.raises(ValueError, match="host_parts"):
        demand(host_parts=(("x", -5),))


class Tower(nn.Module):
    def __init__(self, n=4, d=64):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for blk in self.layers:
            x = x + blk(x)
        return x


def test_model_demand_counts_every_weight_where_it_will_live():
    model = Tower()
    model.embed.requires_grad_(False)  # a frozen part outside the blocks
    for blk in model.layers:
        blk[0].weight.requires_grad_(False)  # frozen, quantizable block linears
    trainable = [(p, 2) for p in model.parameters() if p.requires_grad]  # param_dtype=bf16
    tb = sum(p.numel() * 2 for p, _ in trainable)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    d = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT)
    w = model.layers[0][0].weight.numel()
    assert d.weights_to_move == tb + frozen and d.weights_on_device == 0
    assert d.frozen_weights == 4 * w * 4  # the frozen block linears (what quantize= could shrink), not the embed
    assert d.largest_grad == max(p.numel() * 2 for p, _ in trainable)
    assert d.parameters == sum(p.numel() for p, _ in trainable)
    # int8: the frozen block linears take a byte per element plus an fp32 absmax per 64.
    q = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, quantize="int8")
    int8 = w + 4 * (w // 64)
    assert q.quantized == "int8" and d.weights_to_move - q.weights_to_move == 4 * (4 * w - int8)
    assert q.frozen_weights == 0  # nothing left to advise quantizing
    # "auto" quantizes only what does not fit the usable VRAM.
    roomy = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, quantize="auto",
                                 budget=Budget(vram_usable=GiB))
    assert roomy.quantized is None
    tight = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, quantize="auto",
                                 budget=Budget(vram_usable=d.weights_to_move - 1))
    assert tight.quantized in ("int8", "nf4") and tight.weights_to_move < d.weights_to_move
    # The pager's split: block 1 paged.
    paged = {id(p) for p in model.layers[1].parameters()}
    pg = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, paged=paged, paged_inflight=123)
    blk = model.layers[1]
    blk_bytes = blk[0].weight.numel() * 4 + sum(p.numel() * 2 for p in blk.parameters() if p.requires_grad)
    assert pg.weights_paged == blk_bytes and pg.weights_to_move == d.weights_to_move - blk_bytes
    assert pg.paged_region_bytes == blk[0].weight.numel() * 4 and pg.paged_inflight == 123
    # On the CPU: nothing in VRAM; the host parts count the gradient and the dtype given back.
    c = planner.model_demand(model, trainable, torch.device("cpu"), OPT)
    assert c.weights_to_move == 0 and c.weights_on_device == tb + frozen
    host = dict(c.host_parts)
    assert host["the largest gradient"] == d.largest_grad
    assert host["the parameters given back in their own dtype at unwrap()"] == sum(p.numel() * 2 for p, _ in trainable)
    assert any("streaming buffer" in k for k in host)
    # A model quantized already counts its codes and scales; buffers count too.
    model.register_buffer("table", torch.zeros(1000))
    trainstream.quantize_model(model, "int8", 64, frozen_only=True)
    pre = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT)
    assert pre.weights_to_move == q.weights_to_move + 4000 and pre.frozen_weights == 0


def lora_tower(n=4, d=64, quantize=None):
    """Tower with its block linears frozen (a LoRA-like base), optionally quantized already."""
    model = Tower(n, d)
    for blk in model.layers:
        blk[0].weight.requires_grad_(False)
        blk[2].weight.requires_grad_(False)
    if quantize:
        trainstream.quantize_model(model, quantize, 64, frozen_only=True)
    return model


def test_pageable_blocks_are_sized_as_they_live_quantized_and_in_working_dtype(tsd):
    """The VRAM of paged blocks in flight (the two largest pageable blocks) counts a quantized
    weight at its codes and scales (not its full-precision placeholder) and a trained one in its
    working dtype, as the pager sizes them; plan_wrap() gets the same."""
    model = lora_tower(quantize="int8")
    trainable = [(p, 2) for p in model.parameters() if p.requires_grad]  # param_dtype=bf16
    blocks = [{id(p) for p in blk.parameters()} for blk in model.layers]
    qs = [trainstream.quant.quantized_of(p) for p in model.layers[0].parameters()]
    block = (sum(q.nbytes for q in qs if q is not None)
             + sum(p.numel() * 2 for p in model.layers[0].parameters() if p.requires_grad))
    full = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    assert block < full / 2  # int8 codes and absmax are about a quarter of the fp32 placeholder
    d = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, paged=set().union(*blocks),
                             paged_blocks=blocks)
    assert d.paged_inflight == 2 * block
    assert d.weights_paged == 4 * block and d.paged_region_bytes == 4 * (block - sum(
        p.numel() * 2 for p in model.layers[0].parameters() if p.requires_grad))
    # Through wrap()'s plan (param_offload=[1, 2] on the CPU: the same sizes, two blocks in flight).
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    plan = trainstream.plan_wrap(model, opt, device="cpu", socket=tsd.socket, param_offload=[1, 2],
                                 param_dtype=torch.bfloat16)
    assert plan.demand.paged_inflight == 2 * block
    assert plan.demand.weights_paged == 2 * block
    # The pager's own sizes agree (what the block planner plans with).
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, param_offload=[1, 2],
                                  param_dtype=torch.bfloat16, offload=True)
    try:
        assert trainstream.unwrap_session(model).pager.block_bytes == [block] * 4
    finally:
        trainstream.unwrap(model)


def test_auto_paging_counts_only_the_frozen_weights_it_must_page():
    """param_offload="auto" (the default) may page any block, so the blocks leave the VRAM check;
    but tsd must hold only the frozen share of what cannot stay in the usable VRAM: nothing when
    the model fits (or on a CPU device, where "auto" pages nothing), the frozen share of the
    excess otherwise."""
    model = lora_tower()
    trainable = [(p, 4) for p in model.parameters() if p.requires_grad]
    blocks = [{id(p) for p in blk.parameters()} for blk in model.layers]
    every = set().union(*blocks)
    explicit = planner.model_demand(model, trainable, torch.device("cuda", 0), OPT, paged=every, paged_blocks=blocks)
    frozen = explicit.paged_region_bytes
    assert frozen == sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    outside = explicit.vram_resident  # the embed, the largest gradient, two blocks in flight

    def auto(usable, device=torch.device("cuda", 0)):
        return planner.model_demand(model, trainable, device, OPT, paged=every, paged_blocks=blocks, may_page=True,
                                    budget=Budget(vram_usable=usable))

    roomy = auto(GiB)
    assert roomy.paged_region_bytes == 0 and roomy.vram_resident == outside
    assert roomy.tsd_bytes("float32") == OPT["float32"].state_bytes
    half = explicit.weights_paged // 2
    tight = auto(outside + half)  # half of the blocks' weights must leave the VRAM
    assert tight.paged_region_bytes == -(-frozen * (explicit.weights_paged - half) // explicit.weights_paged)
    assert 0 < tight.paged_region_bytes < frozen
    assert auto(outside // 2).paged_region_bytes == frozen  # every block paged
    cpu = auto(None, torch.device("cpu"))
    assert cpu.weights_paged == 0 and cpu.paged_region_bytes == 0 and cpu.paged_inflight == 0


def test_the_default_does_not_charge_a_frozen_base_that_stays_resident_to_tsd(tsd):
    """A frozen base larger than the quota's room beside the optimizer: with the default
    (param_offload="auto") on a CPU device nothing is paged, so wrap()'s check passes; paging it
    explicitly is refused, naming the paged frozen weights."""
    model = lora_tower(n=4, d=128)
    trainable = [p for p in model.parameters() if p.requires_grad]
    need = trainstream.plan_wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                                 moment_dtype="float32").state_bytes
    quota = need + (64 << 10)
    plan = trainstream.plan_wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                                 moment_dtype="float32", quota=quota)
    assert plan.demand.paged_region_bytes == 0 and plan.state_bytes == need
    with pytest.raises(trainstream.MemoryCheckFailed, match="paged frozen weights"):
        trainstream.plan_wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                              moment_dtype="float32", quota=quota, param_offload=True)


def test_activation_decision_from_the_first_steps_peak():
    blocks = [100 * MiB] * 8
    assert planner.activations_to_page(5 * GiB, None, blocks)[0] == []  # CPU: no VRAM to save
    chosen, why = planner.activations_to_page(GiB, 2 * GiB, blocks)
    assert chosen == [] and "fits" in why
    chosen, why = planner.activations_to_page(2 * GiB + 250 * MiB, 2 * GiB, blocks)
    assert chosen == [0, 1, 2] and "exceeds" in why  # the first blocks: made first, needed last
    chosen, why = planner.activations_to_page(2 * GiB + 250 * MiB, 2 * GiB, [0, 200 * MiB, 0, 100 * MiB])
    assert chosen == [1, 3]  # blocks that saved nothing are skipped
    chosen, why = planner.activations_to_page(4 * GiB, 2 * GiB, blocks)
    assert chosen == list(range(8)) and "less than the excess" in why
    # Never more than tsd can still lend the job.
    chosen, why = planner.activations_to_page(2 * GiB + 250 * MiB, 2 * GiB, blocks, tsd_room=250 * MiB)
    assert chosen == [0, 1] and "larger quota=" in why
    assert planner.activations_to_page(2 * GiB + 250 * MiB, 2 * GiB, blocks, tsd_room=GiB)[0] == [0, 1, 2]


def test_profiler_measures_each_block_and_changes_nothing():
    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    prof = ActivationProfiler(model, list(model.layers), "cpu", name="layers", min_bytes=1)
    prof.install()
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert prof.paged_tensors == 0 and prof.forwards == 4
    assert all(n > 0 for n in prof.block_bytes) and len(set(prof.block_bytes)) == 1  # equal blocks, equal bytes
    # Each block saves its input, the first linear's output and the GELU's output (32x64 + 2x 32x256 fp32).
    assert prof.block_bytes[0] == 4 * (32 * 64 + 2 * 32 * 256)
    with torch.no_grad():
        model(torch.randn(64, 64))  # inference saves nothing and counts nothing
    assert prof.forwards == 4
    prof.remove()
    assert not prof.handles


def test_paging_profiler_measures_the_same_and_pages_what_it_measures():
    """page=True (a first step under a tight budget): the same measurement, every measured tensor
    paged (a plain copy on the CPU), gradients unchanged bit for bit."""
    from trainstream.memory import PinnedHost
    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    plain = ActivationProfiler(ref, list(ref.layers), "cpu", min_bytes=1)
    prof = ActivationProfiler(model, list(model.layers), "cpu", min_bytes=1, page=True, host=PinnedHost(pin=False))
    plain.install()
    prof.install()
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert prof.block_bytes == plain.block_bytes and plain.paged_tensors == 0
    assert prof.paged_bytes == sum(prof.block_bytes) and prof.paged_tensors == 4 * 3
    prof.remove()
    plain.remove()


def test_profiler_starts_paging_where_the_step_would_pass_its_limit():
    """With a limit, the first step pages by itself from the block where the memory allocated,
    the remaining blocks at the largest block's bytes so far and the output head would pass it;
    the blocks before stay on the device, every block is still measured, and the gradients are
    those of an unpaged step bit for bit. The host comes from make_host() then, once."""
    from trainstream.memory import PinnedHost
    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    per = 4 * (32 * 64 + 2 * 32 * 256)  # what each block saves (test above)
    readings = iter([0, 0, 5 * per, 5 * per])  # the device's allocated bytes at each block's forward
    hosts = []

    def make_host():
        hosts.append(PinnedHost(pin=False))
        return hosts[-1]

    prof = ActivationProfiler(model, list(model.layers), "cpu", min_bytes=1, limit=9 * per // 2, make_host=make_host,
                              allocated=lambda: next(readings))
    prof.install()
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    # Block 1: 0 + 3 blocks = 3 per <= 4.5 per; block 2: 5 per + 2 blocks = 7 per > 4.5 per.
    assert prof.started_at == 2 and prof.paging and len(hosts) == 1 and prof.host is hosts[0]
    assert prof.block_bytes == [per] * 4 and prof.paged_bytes == 2 * per and prof.paged_tensors == 2 * 3
    prof.remove()
    # Room for everything: nothing starts; without a limit nothing is read.
    roomy = ActivationProfiler(ref, list(ref.layers), "cpu", min_bytes=1, limit=4 * per, allocated=lambda: 0)
    roomy.install()
    ref(x).square().sum().backward()
    assert roomy.started_at is None and not roomy.paging and roomy.paged_tensors == 0
    roomy.remove()


@pytest.mark.parametrize("weights", [False, True])
def test_decision_after_a_first_step_that_paged_by_itself(weights):
    """After a first step that began paging at block 2 of 4 (2 blocks' bytes off the device):
    without a weight planner, the first blocks cover the excess of the unpaged peak over the
    first step's limit; with one, as many bytes as the step paged (the first two blocks), since
    the weight planner answers for the measured peak's excess itself."""
    from types import SimpleNamespace
    from trainstream.memory import PinnedHost
    from trainstream.allocator import SegmentSwitch
    from trainstream.optim import decide_activation_offload
    from trainstream.planner import Budget

    model = Tower()
    per = 100 * MiB
    prof = ActivationProfiler(model, list(model.layers), "cpu", name="layers", limit=1000 * MiB)
    prof.block_bytes, prof.started_at, prof.paging = [per] * 4, 2, True
    # Measured 1050 MiB with 200 MiB paged: unpaged 1250 MiB, 250 MiB over the 1000 MiB limit.
    session = SimpleNamespace(
        act_pager=prof, cuda=True, client=None, device=torch.device("cpu"), events=[], steps=1, act_refine=None,
        activations_changed_at=-1,
        arena=PinnedHost(pin=False), memory_plan=None, check_memory=False,
        planner=object() if weights else None, pager=SimpleNamespace(reinstall=lambda: None) if weights else None,
        measured_vram=lambda: (Budget(vram_usable=1100 * MiB), 1050 * MiB))
    switched: list[object] = []
    session.segments = SegmentSwitch("auto", cuda=True, setter=switched.append, env={},
                                     release=lambda: switched.append("release"))
    decide_activation_offload(session)
    pager = session.act_pager
    chosen = [i for i, b in enumerate(model.layers) if b in pager.blocks]
    assert chosen == ([0, 1] if weights else [0, 1, 2]), session.events
    # Paging to fit the budget: the allocator makes expandable segments from now on (allocator.py).
    assert switched == [True, "release"]
    assert any(e.startswith(f"allocator: activations of {len(chosen)} blocks are paged") for e in session.events)
    session.segments.restore()
    assert any("paged blocks 2-3 by itself (200.00 MiB)" in e for e in session.events), session.events
    if weights:
        assert any("the weight planner refines from that step's peak" in e for e in session.events), session.events
    pager.remove()


def test_activations_to_keep_brings_back_the_last_paged_blocks_that_fit():
    per = 100 * MiB
    # 1000 MiB usable, 5% margin: 950 MiB; a 700 MiB peak leaves 250 MiB: blocks 2 and 1 come back.
    kept, back, why = planner.activations_to_keep(700 * MiB, 1000 * MiB, [0, 1, 2], [per] * 4, 0.05)
    assert (kept, back) == ([0], [1, 2]), why
    assert "blocks 1-2 (200.00 MiB) stay on the device" in why and "250.00 MiB left less a 5% margin" in why
    # The last block first: a larger one that does not fit keeps the ones before it paged too.
    kept, back, why = planner.activations_to_keep(700 * MiB, 1000 * MiB, [0, 1, 2], [per, per, 3 * per, 0], 0.05)
    assert (kept, back) == ([0, 1, 2], []) and "no paged block's saved activations fit there" in why
    # Over the target already: nothing comes back (the room is shown as 0).
    kept, back, why = planner.activations_to_keep(990 * MiB, 1000 * MiB, [0, 1], [per] * 2, 0.05)
    assert back == [] and "0 B left" in why
    # Room for all of them.
    assert planner.activations_to_keep(0, 1000 * MiB, [0, 1, 2], [per] * 3, 0.05)[:2] == ([], [0, 1, 2])


def first_step_paged(model, per, weights_plan, peak, **extra):
    """A session (the fields activation_auto and decide_activation_offload read) whose first step
    paged blocks 1-3 of `model.layers` (`per` bytes each) by itself beside a weight planner
    (`weights_plan`), with 2000 MiB of usable VRAM and the measured `peak()`."""
    from types import SimpleNamespace
    from trainstream.allocator import SegmentSwitch
    from trainstream.memory import PinnedHost
    from trainstream.planner import Budget

    prof = ActivationProfiler(model, list(model.layers), "cpu", name="layers", limit=1000 * MiB, min_bytes=1)
    prof.block_bytes, prof.started_at, prof.paging = [per] * 4, 1, True
    session = SimpleNamespace(
        act_pager=prof, cuda=True, client=None, device=torch.device("cpu"), events=[], steps=1, act_refine=None,
        arena=PinnedHost(pin=False), memory_plan=None, check_memory=False, planner=weights_plan,
        pager=SimpleNamespace(reinstall=lambda: None, auto=True, paged=set(), blocks=[]), recompute=None,
        measured_vram=lambda: (Budget(vram_usable=2000 * MiB), peak()), auto_share=None, offloading=True, **extra)
    session.segments = SegmentSwitch("auto", cuda=True, setter=lambda _: None, env={}, release=lambda: None)
    return session


class TrimsSeen:
    """A session's host for the tests of the decisions: plain memory that records each trim(keep)."""

    def __init__(self) -> None:
        from trainstream.memory import PinnedHost

        self.host, self.trims = PinnedHost(pin=False), []

    def alloc(self, nbytes):
        return self.host.alloc(nbytes)

    def trim(self, keep_bytes=0):
        self.trims.append(keep_bytes)
        return 0


@pytest.mark.parametrize("room_for", [2, 3])
def test_activation_pages_come_back_once_the_plan_settles(room_for):
    """activation_offload="auto" after its first decision (3 of 4 blocks paged, as many bytes as a
    first step paged by itself): it waits for a step run with the pages and for the weight planner
    to settle, then brings back the last paged blocks the measured peak has room for, once; the
    GPU share and offload="auto"'s switch wait for it. Gradients stay bit-identical."""
    from types import SimpleNamespace
    from trainstream import activation_auto, share_auto
    from trainstream.optim import decide_activation_offload, maybe_switch_to_stock
    from trainstream.units import format_bytes

    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    per = 100 * MiB
    weights_plan = SimpleNamespace(done=False)
    measured = {"peak": 1050 * MiB}
    session = first_step_paged(model, per, weights_plan, lambda: measured["peak"])
    session.arena = TrimsSeen()
    decide_activation_offload(session)
    assert session.arena.trims == [3 * per]  # as many bytes as the first step paged: nothing to give back
    first = session.act_pager
    assert [i for i, b in enumerate(model.layers) if b in first.blocks] == [0, 1, 2]
    assert session.act_refine is not None and session.act_refine.pager is first
    # Right after the decision no step has run with the pages; then the weight planner is not done.
    activation_auto.maybe_refine(session)
    session.steps = 2
    activation_auto.maybe_refine(session)
    assert session.act_pager is first and session.act_refine is not None
    # Meanwhile the GPU share and offload="auto"'s switch wait (they would measure stale pages).
    session.auto_share = share_auto.Pending([], frozenset(), "float32")
    opt = SimpleNamespace(_session=session)
    share_auto.maybe_decide(opt)  # type: ignore[arg-type]
    maybe_switch_to_stock(opt)  # type: ignore[arg-type]
    assert session.auto_share is not None and not hasattr(session, "offload")
    # Settled: 2000 MiB usable less 5% = 1900 MiB; the peak leaves room for `room_for` blocks.
    weights_plan.done = True
    measured["peak"] = 1900 * MiB - room_for * per - per // 2
    activation_auto.maybe_refine(session)
    assert session.act_refine is None
    now = session.act_pager
    paged = [i for i, b in enumerate(model.layers) if now is not None and b in now.blocks]
    assert paged == ([0] if room_for == 2 else []), session.events
    assert session.activation_host_bytes == len(paged) * per
    assert session.arena.trims == [3 * per, len(paged) * per]  # the host beyond the new pages goes back to tsd
    assert any("activation_offload=auto after step 2: measured peak" in e and
               f"blocks {'1-2' if room_for == 2 else '0-2'} ({format_bytes(3 * per - len(paged) * per)}) stay on "
               f"the device" in e for e in session.events), session.events
    # The step's peak was measured with the old pages, and the blocks that came back take the room
    # it left: the GPU share and the switch wait for a step measured with the new layout (with every
    # page back there is no pager left to tell them; on the H100 the share took the same room).
    session.by_param = {}
    share_auto.maybe_decide(opt)  # type: ignore[arg-type]
    maybe_switch_to_stock(opt)  # type: ignore[arg-type]
    assert session.auto_share is not None and not hasattr(session, "offload")
    assert any("decides after the next step (activation_offload=auto changed what is paged or recomputed after "
               "step 2" in e for e in session.events), session.events
    session.steps = 3
    share_auto.maybe_decide(opt)  # type: ignore[arg-type]
    assert session.auto_share is None and "optimizer_gpu_fraction=auto after step 3" in session.events[-1]
    # The old pager's hooks are gone: a step pages only what the new one does, bit for bit the same.
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert first.paged_tensors == 0
    assert (now.paged_tensors > 0) if now is not None else True
    # Once: a later step changes nothing.
    measured["peak"] = 0
    activation_auto.maybe_refine(session)
    assert session.act_pager is now
    if now is not None:
        now.remove()


def test_head_bytes_counts_the_logits_and_the_loss_of_a_language_model_head():
    from trainstream.paging.activations import HEAD_BYTES_PER_LOGIT, head_bytes, hidden_tokens, output_rows

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 100, bias=False)

        def get_output_embeddings(self):
            return self.head

    hidden = torch.zeros(2, 3, 8)
    assert head_bytes(output_rows(LM()), hidden_tokens(hidden)) == 2 * 3 * 100 * HEAD_BYTES_PER_LOGIT
    assert head_bytes(output_rows(Tower()), hidden_tokens(hidden)) == 0  # no output head
    assert head_bytes(output_rows(LM()), hidden_tokens(None)) == 0  # the block got no positional input


# --------------------------------------------------------------------------- wrap() on the CPU
def tower_of_linears():
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])


def test_wrap_refuses_what_cannot_fit_in_ram(tsd, monkeypatch):
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: 64 << 20)  # 64 MiB "free"
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    model = tower_of_linears()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MemoryError, match="host RAM") as e:
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         offload=True, activation_offload=False)
    assert isinstance(e.value, trainstream.MemoryCheckFailed) and "the client process" in str(e.value)
    # Nothing was allocated or changed.
    assert trainstream.unwrap_session(model) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0 and c.status().used_bytes == 0
    # The explicit opt-out still wraps.
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  offload=True, activation_offload=False, check_memory=False)
    trainstream.unwrap(model)


def test_moment_precision_follows_available_ram(tsd, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    model = tower_of_linears()
    p = trainstream.plan_wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                              moment_dtype="float32", check_memory=False)
    fp32, bf16 = p.demand.host_bytes("float32"), p.demand.host_bytes("bfloat16")
    assert bf16 < fp32
    # Room for bf16 moments, not for fp32 ones.
    room = int((fp32 + bf16) / 2 / planner.RAM_HEADROOM)
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: room)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  offload=True, activation_offload=False)
    try:
        assert opt.moment_dtype == "bfloat16"
    finally:
        trainstream.unwrap(model)
    monkeypatch.setattr(planner, "available_ram_bytes", lambda: 64 << 30)
    model = tower_of_linears()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  offload=True, activation_offload=False)
    try:
        assert opt.moment_dtype == "float32"
    finally:
        trainstream.unwrap(model)


def test_activation_offload_auto_is_the_default_and_pages_nothing_on_the_cpu(tsd):
    model = make_gpt(0)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cpu",
                                  socket=tsd.socket)
    session = trainstream.unwrap_session(model)
    try:
        assert session.act_pager is None
        assert any("activation_offload=auto" in e and "nothing paged" in e for e in session.events)
        assert any(e.startswith("wrap:") and "host RAM" in e and "this process may take" in e for e in session.events)
        train(model, opt, batches(2), 2)
        assert session.act_pager is None and session.arena is None
    finally:
        trainstream.unwrap(model)


# --------------------------------------------------------------------------- CUDA
@cuda
def test_cuda_wrap_refuses_weights_beyond_the_usable_vram(tsd):
    model = tower_of_linears().cuda()
    with pytest.raises(trainstream.MemoryCheckFailed, match="usable VRAM") as e:
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda", socket=tsd.socket,
                         budget=Budget(vram_usable=8 * MiB))
    assert "param_offload='auto'" in str(e.value)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda", socket=tsd.socket,
                                  budget=Budget(vram_usable=8 * MiB), check_memory=False, offload=True)
    trainstream.unwrap(model)


@cuda
def test_cuda_wrap_counts_the_per_process_memory_fraction(tsd):
    """A set_per_process_memory_fraction cap below the model: wrap() refuses before moving it."""
    total = torch.cuda.get_device_properties(0).total_memory
    model = tower_of_linears()  # 33.6 MB of fp32 weights, on the CPU
    torch.cuda.set_per_process_memory_fraction(16 * MiB / total, 0)
    try:
        b = planner.measure_device("cuda")
        assert b.vram_usable <= int(16 * MiB * planner.VRAM_HEADROOM) + 1 and b.vram_free <= 16 * MiB
        with pytest.raises(trainstream.MemoryCheckFailed, match="do not fit") as e:
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda", socket=tsd.socket)
        assert e.value.refusals[0].what in ("vram_free", "vram_usable")
        assert all(p.device.type == "cpu" for p in model.parameters())  # nothing moved
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


@cuda
@pytest.mark.parametrize("rec", [False, "auto"])
@pytest.mark.parametrize("po", [False, "auto"])
def test_cuda_activation_offload_auto_pages_what_the_budget_needs_bit_identically(tsd, request, po, rec):
    """Under a usable VRAM below the first step's peak, "auto" pages the first blocks'
    activations from the second step on (with activation_recompute="auto", the default, it
    recomputes them instead), and the run equals an unpaged one bit for bit; with room, it pages
    nothing. With param_offload="auto" (the default) too: the block planner resets torch's peak
    after the first step, and the activation decision still sees that step's peak (and the
    planner pages every block's weights under 1 MiB)."""
    data = batches(4, batch=256, device="cuda")
    out = {}
    # Two runs of this model can agree bit for bit only with deterministic kernels: at batch 256
    # the embedding's backward (atomic adds on the GPU) sums its many repeated tokens in a varying
    # order. Without this, on the H200 the 4th loss of the paged and the unpaged run differed in
    # its last bits, while every other paging comparison there (smaller batches) was bit-exact.
    torch.use_deterministic_algorithms(True, warn_only=True)
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(False))
    for usable in (1 << 40, 1 << 20):
        model = make_gpt(0, d=256, layers=4, heads=4).cuda()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, budget=Budget(vram_usable=usable),
                                      check_memory=False, param_offload=po, activation_recompute=rec)
        session = trainstream.unwrap_session(model)
        try:
            assert isinstance(session.act_pager, ActivationProfiler), (usable, session.events)
            session.act_pager.min_bytes = 1024
            losses = train(model, opt, data, 4)
            if usable == 1 << 40:
                assert session.act_pager is None and any("nothing paged" in e for e in session.events)
                assert session.recompute is None
            elif rec == "auto":  # recomputed from the second step on, nothing paged
                assert session.act_pager is None and session.activation_host_bytes == 0, session.events
                assert session.recompute is not None and session.recompute.blocks_recomputed, session.events
                assert any("instead of paging them; activation_offload=auto after the first step" in e
                           for e in session.events), session.events
            else:
                assert session.act_pager is not None and not isinstance(session.act_pager, ActivationProfiler)
                assert session.act_pager.paged_bytes > 0 and session.arena is not None
                assert session.recompute is None
                assert any("activation_offload=auto after the first step" in e for e in session.events)
                if po == "auto":
                    assert session.pager.paged == {0, 1, 2, 3}
                else:  # the weights fit, so the first step paged by itself, from block 0 (1 MiB usable)
                    assert any("paged blocks 0-3 by itself" in e for e in session.events), session.events
        finally:
            trainstream.unwrap(model)
        # After unwrap(): a paged block's parameters are empty tensors while wrapped.
        out[usable] = (losses, [p.detach().clone() for p in model.parameters()])
    (l0, p0), (l1, p1) = out[1 << 40], out[1 << 20]
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
def test_cuda_tight_first_step_refuses_clearly_what_tsd_cannot_lend_and_trains_after(tsd, request):
    """Under a tight budget the first step pages every block's weights and activations. When the
    job's quota can lend no activation page, that step fails with QuotaExceeded naming the block,
    what the step needs and what to change (not an out-of-memory error later); nothing is trained,
    and once the quota has room the run trains exactly as one that never failed."""
    data = batches(4, batch=256, device="cuda")
    torch.use_deterministic_algorithms(True, warn_only=True)  # see the test above
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(False))

    def wrapped(job):
        model = make_gpt(0, d=256, layers=4, heads=4).cuda()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, budget=Budget(vram_usable=1 << 20),
                                      check_memory=False, param_offload="auto", job=job, quota="512MiB")
        session = trainstream.unwrap_session(model)
        assert isinstance(session.act_pager, ActivationProfiler) and session.act_pager.paging, session.events
        session.act_pager.min_bytes = 1024
        return model, opt, session

    model, opt, _ = wrapped("tight-ref")
    try:
        want = train(model, opt, data, 4)
    finally:
        trainstream.unwrap(model)
    model, opt, session = wrapped("tight-act")
    try:
        with trainstream.connect(socket=tsd.socket, job="tight-act") as other:
            free = 512 * 2**20 - next(j for j in other.jobs() if j.name == "tight-act").used_bytes
            hog = other.alloc("hog", free)  # the rest of the job's quota
            with pytest.raises(trainstream.QuotaExceeded) as e:
                train(model, opt, data[:1], 1)
            msg = str(e.value)
            assert "tsd can lend no more in block 0 of 4" in msg and "--pool-size" in msg, msg
            assert session.steps == 0 and all(p.grad is None for p in model.parameters())
            del e
            gc.collect()  # the failed forward's graph and pages go with the traceback
            other.free(hog)
            losses = train(model, opt, data, 4)
        assert any("activation_offload=auto after the first step" in ev for ev in session.events), session.events
    finally:
        trainstream.unwrap(model)
    assert losses == want


def test_activation_pages_are_checked_against_the_host_ram_after_the_first_step():
    """check_memory's second half: the activation pages the first step chose, on top of the host
    memory wrap() counted, must fit what wrap() found this process may take; a run that does not
    is refused naming both parts, and one that does records them (the benchmark's host bound)."""
    from types import SimpleNamespace

    from trainstream.optim import check_activation_host

    plan = SimpleNamespace(host_bytes=80 * GiB, host_room=96 * GiB)
    s = SimpleNamespace(memory_plan=plan, check_memory=True, activation_host_bytes=0)
    check_activation_host(s, 12 * GiB)
    assert s.activation_host_bytes == 12 * GiB
    with pytest.raises(trainstream.MemoryCheckFailed) as e:
        check_activation_host(s, 17 * GiB)
    assert "17.00 GiB of saved activations" in str(e.value) and "80.00 GiB wrap() counted" in str(e.value)
    assert "97.00 GiB of the 96.00 GiB" in str(e.value) and "Lower the batch" in str(e.value)
    (r,) = e.value.refusals
    assert (r.what, r.needed, r.available) == ("host", 97 * GiB, 96 * GiB)
    s.check_memory = False  # the user said so: recorded, not refused
    check_activation_host(s, 17 * GiB)
    assert s.activation_host_bytes == 17 * GiB
    s.memory_plan = SimpleNamespace(host_bytes=80 * GiB, host_room=None)  # RAM not measured: nothing to check
    s.check_memory = True
    check_activation_host(s, 40 * GiB)


class _ShortHost:
    """A host that lends up to `room` bytes at once, then refuses as tsd does when the job's quota
    is full; `capacity_bytes` is what it lends now (blocks given back return to it)."""

    def __init__(self, room):
        self.room, self.capacity_bytes, self._next = room, 0, 0
        self._lent = {}

    def alloc(self, nbytes):
        from trainstream.memory import HostBlock
        if self.capacity_bytes + nbytes > self.room:
            raise trainstream.QuotaExceeded(f"tsd cannot lend {nbytes} bytes more for activation paging; quota full")
        self.capacity_bytes += nbytes
        self._next += 1
        self._lent[self._next] = nbytes
        return HostBlock(torch.empty(nbytes, dtype=torch.uint8), self, self._next)

    def _give_back(self, key, after):
        self.capacity_bytes -= self._lent.pop(key)


def test_paging_profiler_refuses_clearly_what_tsd_cannot_lend_and_the_step_runs_again():
    """The first step of a tight budget pages every block's activations; when tsd's quota runs out
    in it, the step fails with QuotaExceeded saying about how much more it needs and what to change
    (keeping the rest on the device would overrun the VRAM budget the plan was made for). Nothing
    is trained, the failed forward's host blocks go back, and once tsd can lend enough the same
    step gives the reference's gradients bit for bit; the decision after it pages every block."""
    from types import SimpleNamespace

    from trainstream.optim import decide_activation_offload

    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    per_block = 4 * (32 * 64 + 2 * 32 * 256)
    host = _ShortHost(room=per_block + per_block // 2)  # block 0 whole, half of block 1
    prof = ActivationProfiler(model, list(model.layers), "cpu", name="layers", min_bytes=1, page=True, host=host)
    prof.install()
    x = torch.randn(32, 64)
    with pytest.raises(trainstream.QuotaExceeded) as e:
        model(x).square().sum().backward()
    msg = str(e.value)
    assert "tsd can lend no more in block 1 of 4" in msg and "quota full" in msg, msg
    assert "--pool-size" in msg and "quota=" in msg and "smaller batch" in msg and "run again" in msg
    # Blocks 1-3 at the largest block's bytes so far (block 0's), less the 8 KiB block 1 paged before the refusal.
    assert "80.00 KiB lent so far; about 72.00 KiB per block, so about 208.00 KiB more" in msg, msg
    assert all(p.grad is None for p in model.parameters())  # nothing trained
    del e
    gc.collect()  # the failed forward's graph (and its pages) go with the traceback
    assert host.capacity_bytes == 0  # every block it lent came back
    host.room *= 4  # the user starts tsd with a larger pool
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert prof.block_bytes == [per_block] * 4
    s = SimpleNamespace(act_pager=prof, arena=host, device=torch.device("cpu"), pager=None, events=[],
                        memory_plan=None, check_memory=True, activation_host_bytes=0, steps=1, cuda=False)
    decide_activation_offload(s)
    assert s.act_pager is not prof and list(s.act_pager.blocks) == list(model.layers)
    assert "stay off the device so that the weight planner's measured peak holds" in s.events[-1], s.events
    s.act_pager.remove()


class _LM(nn.Module):
    """A language model's shape for the head check: ids in, logits out of a 1000-word head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 1000, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids=None, inputs_embeds=None):
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def test_first_forward_pages_every_block_when_the_head_would_not_fit(monkeypatch):
    """paging.first_step: at the first training forward, allocated + the head's logits and loss
    (tokens x vocabulary x 10 bytes) + what is in flight against the planner's target: over it,
    every block is paged for that step (once, then the hook is gone); under it, nothing moves;
    an evaluation forward is not the one checked."""
    from types import SimpleNamespace
    from trainstream.paging import first_step
    from trainstream.paging.activations import HEAD_BYTES_PER_LOGIT

    assert first_step.batch_tokens((), {"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == 10
    assert first_step.batch_tokens((torch.zeros(3, 4, dtype=torch.long),), {}) == 12
    assert first_step.batch_tokens((), {"inputs_embeds": torch.zeros(2, 5, 16)}) == 10
    assert first_step.batch_tokens((), {}) is None

    head = 8 * 1000 * HEAD_BYTES_PER_LOGIT  # 2x4 tokens
    for target, moves in ((MiB + head + 99, True), (MiB + head + 100, False), (MiB + head + 101, False)):
        model = _LM()
        moved = []
        pager = SimpleNamespace(paged=set(), closed=False, blocks=list(model.layers),
                                move_to=lambda s: (moved.append(sorted(s)), setattr(pager, "paged", set(s))),
                                install=lambda: moved.append("install"))
        planner = SimpleNamespace(steps=0, target=target, inflight_bytes=100)  # 1 MiB allocated + head + 100
        session = SimpleNamespace(pager=pager, planner=planner, cuda=True, device=torch.device("cpu"), events=[],
                                  head_check=None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: MiB)
        first_step.install(session, model)
        assert session.head_check is not None
        with torch.no_grad():
            model(input_ids=torch.zeros(2, 4, dtype=torch.long))
        assert session.head_check is not None and not moved  # evaluation: not checked
        model(input_ids=torch.zeros(2, 4, dtype=torch.long))
        assert session.head_check is None
        if moves:
            assert moved == [[0, 1, 2, 3], "install"], moved
            assert any("the first step pages all 4 blocks" in e for e in session.events), session.events
        else:
            assert moved == [] and session.events == []
        model(input_ids=torch.zeros(2, 4, dtype=torch.long))  # the hook is gone
        assert moved == ([[0, 1, 2, 3], "install"] if moves else [])


@cuda
def test_cuda_head_check_pages_the_first_step_and_changes_no_result(tsd, request):
    """A Qwen2 model whose weights fit the budget but whose first step's logits (4,096 tokens x a
    32,000-word head x 10 bytes: 1.2 GiB) do not: the head check pages every block in the first
    step, the measured peaks move blocks back, and the losses and parameters equal those of the
    same run without a budget bit for bit."""
    transformers = pytest.importorskip("transformers")
    from hf_data import train_causal_lm
    torch.use_deterministic_algorithms(True, warn_only=True)
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(False))
    cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 32000, (8, 512), generator=g).cuda() for _ in range(4)]
    out = {}
    for budget in (None, Budget(vram_usable=512 << 20)):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(cfg).cuda()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, budget=budget, check_memory=False,
                                      param_offload="auto")
        session = trainstream.unwrap_session(model)
        try:
            losses = train_causal_lm(model, opt, data)
            paged_first = any("the first step pages all 4 blocks" in e for e in session.events)
            assert paged_first == (budget is not None), session.events
        finally:
            trainstream.unwrap(model)
        out[budget is None] = (losses, [p.detach().clone() for p in model.parameters()])
    (l0, p0), (l1, p1) = out[True], out[False]
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))
