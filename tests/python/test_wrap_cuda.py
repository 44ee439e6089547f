"""The CUDA path of wrap(): D2H on a side stream into pinned slots, doorbells rung from the stream,
H2D copies back; offload="auto" under a VRAM cap. Skipped without a GPU (run on the GPU machine)."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import trainstream
from gpt import batches, make_gpt, max_diff, param_groups, train
from test_wrap_cpu import HP, master_reference, schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("accumulation,max_grad_norm", [(1, None), (2, 0.05)])
def test_cuda_gpt_20_steps_equal_torch_adamw(tsd, accumulation, max_grad_norm):
    ref = make_gpt().cuda()
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(param_groups(ref, 0.1, 3e-3), foreach=False, **HP)
    data = batches(20 * accumulation, device="cuda")
    a = train(ref, opt_ref, data, 20, accumulation, max_grad_norm, torch.optim.lr_scheduler.LambdaLR(opt_ref, schedule),
              stock=True)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(param_groups(mine, 0.1, 3e-3), **HP), device="cuda",
                                 socket=tsd.socket, max_grad_norm=max_grad_norm, accumulation_steps=accumulation,
                                 offload=True)
    try:
        assert all(ps.grad_slot.is_pinned() for ps in trainstream.unwrap_session(mine).params)
        b = train(mine, opt, data, 20, accumulation, max_grad_norm, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    finally:
        trainstream.unwrap(mine)
    diff = max_diff(ref, mine)
    print(f"cuda fp32 accumulation={accumulation} max_grad_norm={max_grad_norm}: max |param diff| = {diff:.3g}")
    assert diff <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    assert all(p.is_cuda for p in mine.parameters())


def test_cuda_bf16_model_matches_fp32_master_reference(tsd):
    data = batches(20, device="cuda")
    ref = make_gpt(0, torch.bfloat16).cuda()
    mine = copy.deepcopy(ref)
    a, _ = master_reference(ref, lambda m: param_groups(m, 0.1, 3e-3), 20, data, max_grad_norm=1.0)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(param_groups(mine, 0.1, 3e-3), **HP), device="cuda",
                                 socket=tsd.socket, max_grad_norm=1.0, offload=True)
    try:
        b = train(mine, opt, data, 20, 1, 1.0, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    finally:
        trainstream.unwrap(mine)
    print(f"cuda bf16: max |param diff| = {max_diff(ref, mine):.3g}, max |loss diff| = "
          f"{max(abs(x - y) for x, y in zip(a, b)):.3g}")
    assert max_diff(ref, mine) <= 2e-3
    assert b == pytest.approx(a, abs=1e-3)


def test_cuda_gradients_leave_vram(tsd):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    stock = copy.deepcopy(model)
    opt_s = torch.optim.AdamW(stock.parameters())
    x = torch.randn(64, 1024, device="cuda")

    def one(m, o):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(2):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p_stock = one(stock, opt_s)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda", socket=tsd.socket,
                                  offload=True)
    try:
        p_mine = one(model, opt)
    finally:
        trainstream.unwrap(model)
    weights = sum(p.numel() * 4 for p in model.parameters())
    print(f"peak VRAM of 2 steps: stock {p_stock / 2**20:.1f} MiB, through tsd {p_mine / 2**20:.1f} MiB")
    assert p_stock - p_mine >= 2 * weights  # both moments; gradients too, minus the ones in flight


def test_cuda_activation_offload_is_bit_identical_and_lowers_the_peak(tsd):
    """Paging the blocks' activations to host memory lent by tsd (CUDA-registered regions of the
    job) changes no bit of the result (losses, parameters) and lowers peak VRAM; param_dtype=bf16
    with autocast, as the benchmark runs."""
    data = batches(5, batch=256, device="cuda")
    out = {}
    for act in (False, True):
        model = make_gpt(0, d=256, layers=4, heads=4).cuda()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, param_dtype=torch.bfloat16,
                                      activation_offload=act)
        session = trainstream.unwrap_session(model)
        pager = session.act_pager
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses = train(model, opt, data[:1], 1)
                grows = session.arena.grows if act else 0
                losses += train(model, opt, data[1:], 4)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            paged = pager.paged_bytes if pager is not None else 0
            if act:
                # Every block is paged: the backward of blocks 3, 2 and 1 starts the copies back of
                # blocks 2, 1 and 0 ahead of their unpack, in every step.
                assert pager.prefetched_tensors >= 5 * 3, pager.prefetched_tensors
            params = [p.detach().clone() for p in model.parameters()]  # bf16 working copies
            if act:
                arena = session.arena
                assert arena.regions and all(r.cuda_registered for r in arena.regions)
                assert arena.grows == grows  # the first step's blocks are reused by the next four
                with trainstream.connect(socket=tsd.socket) as c:
                    job = next(j for j in c.jobs() if j.name == session.client.job)
                assert job.used_bytes == session.state_bytes + arena.capacity_bytes
        finally:
            trainstream.unwrap(model)
        out[act] = (losses, params, peak, paged)
        print(f"activation_offload={act}: peak {peak / 2**20:.1f} MiB, paged {paged / 2**20:.1f} MiB over 5 steps")
    (l0, p0, peak0, _), (l1, p1, peak1, paged) = out[False], out[True]
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert paged > 0
    assert peak1 < peak0


def test_cuda_daemon_killed_raises(own_tsd):
    model = make_gpt().cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda",
                                  socket=own_tsd.socket, offload=True)
    data = batches(3, device="cuda")
    train(model, opt, data[:1], 1)
    own_tsd.kill()
    with pytest.raises(trainstream.TsdError):
        train(model, opt, data[1:], 2)
    trainstream.unwrap(model)


AUTO_SCRIPT = textwrap.dedent(r"""
    import json, sys, torch
    sys.path.insert(0, HERE)
    import trainstream
    cap = CAP
    if cap:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory, 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()  # 50M params, 200 MB
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device="cuda",
                                  socket=SOCKET)
    x = torch.randn(64, 2048, device="cuda")
    losses = []
    for _ in range(5):
        loss = model(x).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
    s = trainstream.unwrap_session(model)
    print("@@" + json.dumps(dict(offloading=opt.offloading, events=s.events, losses=losses)))
""")


@pytest.mark.parametrize("cap_mb,switches", [(0, True), (600, False)])
def test_offload_auto_switches_only_when_stock_adamw_fits(tsd, cap_mb, switches):
    code = AUTO_SCRIPT.replace("HERE", repr(HERE)).replace("CAP", str(cap_mb << 20)).replace("SOCKET", repr(tsd.socket))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("@@")][-1][2:])
    print(res["events"])
    assert res["offloading"] is (not switches)
    assert any(("switched" if switches else "keeps offloading") in e for e in res["events"])
    assert res["losses"][-1] < res["losses"][0]


def test_cuda_activation_offload_leaves_checkpointed_blocks_to_checkpointing(tsd):
    """Gradient checkpointing around blocks 0 and 2 (non-reentrant, as Hugging Face models run
    it) with every block's activations paged: only blocks 1 and 3 are paged, the checkpointed
    blocks are still recomputed (each runs twice a step), and the result is bit-identical to the
    same checkpointed run without paging."""
    from torch.utils.checkpoint import checkpoint

    from gpt import GPT

    class HalfCheckpointed(GPT):
        def forward(self, idx):  # checkpoint around the block's call, hooks inside, as Hugging Face's layers
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for i, blk in enumerate(self.blocks):
                x = checkpoint(blk, x, use_reentrant=False) if i % 2 == 0 and torch.is_grad_enabled() else blk(x)
            return self.head(self.ln(x))

    data = batches(3, batch=128, device="cuda")
    out = {}
    for act in (False, True):
        torch.manual_seed(0)
        model = HalfCheckpointed(d=256, layers=4, heads=4).cuda()
        runs = [0] * 4
        for i, blk in enumerate(model.blocks):
            blk.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, activation_offload=act)
        pager = trainstream.unwrap_session(model).act_pager
        try:
            losses = train(model, opt, data, 3)
            params = [p.detach().clone() for p in model.parameters()]
            paged = pager.paged_tensors if pager is not None else 0
        finally:
            trainstream.unwrap(model)
        out[act] = (losses, params, runs, paged)
        print(f"activation_offload={act}: block forwards {runs}, paged tensors {paged}")
    (l0, p0, r0, _), (l1, p1, r1, paged) = out[False], out[True]
    assert r0 == r1 == [6, 3, 6, 3]
    assert paged > 0 and l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_cuda_activation_recompute_is_bit_identical_beside_both_pagers(tsd):
    """activation_recompute=[0, 2] beside every block's activations paged and blocks 1 and 2's
    weights paged, bf16 weights under autocast as the benchmark runs: losses and parameters equal
    the run that recomputes nothing, and the recomputed blocks page nothing."""
    data = batches(4, batch=256, device="cuda")
    out = {}
    for rec in (False, [0, 2]):
        model = make_gpt(0, d=256, layers=4, heads=4).cuda()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, offload=True, param_dtype=torch.bfloat16,
                                      activation_offload=True, param_offload=[1, 2], activation_recompute=rec)
        session = trainstream.unwrap_session(model)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses = train(model, opt, data, 4)
            params = [p.detach().float().cpu().clone() for p in model.state_dict().values()]
            pages = [len(p) for p in session.act_pager.block_pages]
            ahead = session.act_pager.prefetched_tensors
        finally:
            trainstream.unwrap(model)
        out[bool(rec)] = (losses, params, pages, ahead)
        print(f"activation_recompute={rec}: pages per block in the last forward {pages}, {ahead} copied back ahead")
    (l0, p0, _, _), (l1, p1, pages, ahead) = out[False], out[True]
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert pages[0] == pages[2] == 0 and pages[1] > 0 and pages[3] > 0
    # Block 3's backward starts block 1's copies back ahead, past block 2 (recomputed, no pages).
    assert ahead >= 4, ahead
