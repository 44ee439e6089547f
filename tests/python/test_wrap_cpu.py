"""trainstream.wrap() on device="cpu": the whole streaming path (hooks, slots, doorbells, the
daemon's AdamW, copies back) against torch.optim.AdamW(foreach=False) on a small GPT."""
import copy
import math
import re

import pytest
import torch
from torch import nn

import trainstream
from gpt import GPT, batches, loss_of, make_gpt, max_diff, param_groups, train

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def schedule(step):
    return min(1.0, (step + 1) / 4) * 0.95 ** step  # warm-up, then decay: a new lr every step


def pair(dtype=torch.float32, lr2=3e-3, wd=0.1, seed=0, **gpt_kw):
    """(reference model, its stock AdamW), (model, AdamW to wrap): equal starting points."""
    ref = make_gpt(seed, dtype, **gpt_kw)
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(param_groups(ref, wd, lr2), foreach=False, **HP)
    opt = torch.optim.AdamW(param_groups(mine, wd, lr2), **HP)
    return ref, opt_ref, mine, opt


def run_both(tsd, steps=20, accumulation=1, max_grad_norm=None, dtype=torch.float32, **wrap_kw):
    ref, opt_ref, mine, opt = pair(dtype)
    data = batches(steps * accumulation)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, schedule)
    a = train(ref, opt_ref, data, steps, accumulation, max_grad_norm, sched_ref, stock=True)
    mine, opt = trainstream.wrap(mine, opt, device="cpu", socket=tsd.socket, max_grad_norm=max_grad_norm,
                                 accumulation_steps=accumulation, **wrap_kw)
    try:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        b = train(mine, opt, data, steps, accumulation, max_grad_norm, sched)
        opt.saved = opt.state_dict()  # read from the daemon while the job exists
        return ref, opt_ref, mine, opt, a, b
    finally:
        trainstream.unwrap(mine)


@pytest.mark.parametrize("accumulation,max_grad_norm", [(1, None), (2, None), (1, 1.0), (2, 0.05)])
def test_gpt_20_steps_equal_torch_adamw(tsd, accumulation, max_grad_norm):
    """Two groups (one without weight decay, its own lr), an LR scheduler, tied weights, and
    accumulation and clipping each on and off. Clipping at 0.05 bites at every step."""
    ref, opt_ref, mine, opt, a, b = run_both(tsd, 20, accumulation, max_grad_norm)
    diff = max_diff(ref, mine)
    print(f"fp32 accumulation={accumulation} max_grad_norm={max_grad_norm}: max |param diff| = {diff:.3g}")
    assert diff <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    assert a[-1] < a[0]  # it trained
    # The saved state is torch.optim.AdamW's, numerically.
    sd, sd_ref = opt.saved, opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert float(sd["state"][i]["step"]) == float(st["step"]) == 20
        for k in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][i][k] - st[k]).abs().max().item() <= 1e-6 * max(1.0, st[k].abs().max().item())
    assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in sd_ref["param_groups"]]


def master_reference(model, groups_fn, steps, data, max_grad_norm=None, init=None):
    """Mixed precision done by hand: a low-precision model, fp32 master weights stepped by
    torch.optim.AdamW(foreach=False) on the upcast gradients, rounded back into the model.
    This is what tsd does for bf16/fp16 models. `init`: fp32 starting values by parameter name
    (default: the model's own, upcast)."""
    named = dict(model.named_parameters())
    start = {id(p): (init[n] if init is not None else p.detach()) for n, p in named.items()}
    masters = {p: start[id(p)].float().clone().requires_grad_(True) for p in model.parameters()}
    groups = [{**g, "params": [masters[p] for p in g["params"]]} for g in groups_fn(model)]
    opt = torch.optim.AdamW(groups, foreach=False, **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    for t in data[:steps]:
        loss = loss_of(model, t)
        loss.backward()
        for p, m in masters.items():
            m.grad = None if p.grad is None else p.grad.float()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), max_grad_norm)
        opt.step()
        sched.step()
        model.zero_grad()
        with torch.no_grad():
            for p, m in masters.items():
                p.copy_(m)
        losses.append(loss.item())
    return losses, masters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_keep_fp32_masters(tsd, dtype):
    """bf16/fp16 parameters, gradients and parameter slots; fp32 master weights in the daemon.
    Equal to the hand-made fp32-master reference; close to stock AdamW on the bf16 parameters."""
    steps = 20
    data = batches(steps)
    ref = make_gpt(0, dtype)
    mine = copy.deepcopy(ref)
    stock = copy.deepcopy(ref)
    a, masters = master_reference(ref, lambda m: param_groups(m, 0.1, 3e-3), steps, data, max_grad_norm=1.0)
    opt = torch.optim.AdamW(param_groups(mine, 0.1, 3e-3), **HP)
    mine, opt = trainstream.wrap(mine, opt, device="cpu", socket=tsd.socket, max_grad_norm=1.0)
    try:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        b = train(mine, opt, data, steps, 1, 1.0, sched)
        sd = opt.state_dict()
    finally:
        trainstream.unwrap(mine)
    params = list(mine.parameters())
    name_of = {id(p): n for n, p in mine.named_parameters()}
    ref_by_name = dict(ref.named_parameters())
    in_order = [p for g in opt.param_groups for p in g["params"]]  # state_dict's indices
    master_diff = max((sd["state"][i]["master"] - masters[ref_by_name[name_of[id(p)]]]).abs().max().item()
                      for i, p in enumerate(in_order))
    param_diff = max_diff(ref, mine)
    print(f"{dtype}: max |master diff| vs fp32-master reference = {master_diff:.3g}, "
          f"max |param diff| = {param_diff:.3g}, max |loss diff| = {max(abs(x - y) for x, y in zip(a, b)):.3g}")
    assert all(p.dtype == dtype for p in params)
    # One-ulp differences between tsd's AdamW and ATen's (both correct) occasionally round a
    # parameter to the neighbouring bf16/fp16 value, and the runs drift apart by about that much:
    # the tolerances docs/python.md states. The drift depends on the kernel path: 2e-5 with
    # AVX-512, 2.07e-4 on an AVX2-only host (one flipped bf16 rounding moves its gradients).
    assert master_diff <= 5e-4
    assert param_diff <= 2e-3
    assert b == pytest.approx(a, abs=1e-3)
    if dtype == torch.float16:
        return  # stock AdamW on fp16 parameters is no reference: eps=1e-8 underflows and it goes NaN
    # Stock AdamW stepping the bf16 parameters themselves loses the small updates tsd's fp32
    # masters keep; the losses still agree to the tolerance docs/python.md states.
    opt_stock = torch.optim.AdamW(param_groups(stock, 0.1, 3e-3), foreach=False, **HP)
    c = train(stock, opt_stock, data, steps, 1, 1.0, torch.optim.lr_scheduler.LambdaLR(opt_stock, schedule), stock=True)
    print(f"{dtype}: max |loss diff| vs stock AdamW on {dtype} parameters = {max(abs(x - y) for x, y in zip(c, b)):.3g}")
    assert b == pytest.approx(c, abs=0.01)


def test_param_dtype_keeps_bf16_working_copies_and_fp32_masters(tsd):
    """param_dtype=torch.bfloat16 on an fp32 model: the model trains in bf16 while tsd's masters
    start from (and keep) the fp32 values; unwrap() gives fp32 parameters equal to the masters."""
    steps = 20
    data = batches(steps)
    full = make_gpt(0, torch.float32)
    init = {n: p.detach().clone() for n, p in full.named_parameters()}
    ref = copy.deepcopy(full).to(torch.bfloat16)
    a, masters = master_reference(ref, lambda m: param_groups(m, 0.1, 3e-3), steps, data, max_grad_norm=1.0,
                                  init=init)
    mine = copy.deepcopy(full)
    opt = torch.optim.AdamW(param_groups(mine, 0.1, 3e-3), **HP)
    mine, opt = trainstream.wrap(mine, opt, device="cpu", socket=tsd.socket, max_grad_norm=1.0,
                                 param_dtype=torch.bfloat16)
    try:
        assert all(p.dtype == torch.bfloat16 for p in mine.parameters())
        # The masters start from the fp32 values, not from their bf16 rounding.
        sd0 = opt.state_dict()
        assert sd0["state"] == {}
        session = trainstream.unwrap_session(mine)
        assert all(torch.equal(ps.master.view(ps.param.shape), init[n])
                   for n, p in mine.named_parameters() for ps in [session.by_param[id(p)]])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        b = train(mine, opt, data, steps, 1, 1.0, sched)
        sd = opt.state_dict()
        working = {n: p.detach().clone() for n, p in mine.named_parameters()}
    finally:
        trainstream.unwrap(mine)
    name_of = {id(p): n for n, p in mine.named_parameters()}
    ref_by_name = dict(ref.named_parameters())
    in_order = [p for g in opt.param_groups for p in g["params"]]
    master_diff = max((sd["state"][i]["master"] - masters[ref_by_name[name_of[id(p)]]]).abs().max().item()
                      for i, p in enumerate(in_order))
    param_diff = max((working[n].float() - p.detach().float()).abs().max().item() for n, p in ref.named_parameters())
    print(f"param_dtype=bf16: max |master diff| = {master_diff:.3g}, max |bf16 param diff| = {param_diff:.3g}")
    assert master_diff <= 1e-4
    assert param_diff <= 2e-3
    assert b == pytest.approx(a, abs=1e-3)
    # unwrap(): fp32 parameters holding exactly the masters' values.
    for i, p in enumerate(in_order):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), sd["state"][i]["master"])


def test_param_dtype_is_checked(tsd):
    model = make_gpt(0)
    with pytest.raises(ValueError, match="param_dtype must be"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         param_dtype=torch.int8)
    assert trainstream.unwrap_session(model) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_activation_offload_is_bit_identical(tsd):
    """Paged activations (every block, and block 1 only) give the very same losses and
    parameters as an unpaged run; the pager pages each saved tensor once and keeps weights."""
    data = batches(6)
    runs = {}
    for act in (False, True, [1]):
        model = make_gpt(0, d=64)
        opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, activation_offload=act,
                                      max_grad_norm=1.0)
        session = trainstream.unwrap_session(model)
        pager = session.act_pager
        try:
            if act is False:
                assert pager is None
            else:
                # min_bytes at 1 MiB would page nothing of this small model.
                pager.min_bytes = 1024
                assert any("activation_offload" in e for e in session.events)
            losses = train(model, opt, data, 6, 1, 1.0)
            if pager is not None:
                assert pager.paged_tensors > 0 and pager.paged_bytes > 0
                runs[f"paged {act}"] = pager.paged_bytes
        finally:
            trainstream.unwrap(model)
        runs[repr(act)] = (losses, [p.detach().clone() for p in model.parameters()])
    base_losses, base_params = runs["False"]
    for act in ("True", "[1]"):
        losses, params = runs[act]
        assert losses == base_losses, act
        assert all(torch.equal(a, b) for a, b in zip(params, base_params)), act
    assert runs["paged True"] > runs["paged [1]"] > 0  # two blocks page more than one


def test_activation_pager_keeps_weights_and_pages_shared_tensors_once():
    from trainstream.paging.activations import ActivationPager

    torch.manual_seed(0)
    seq = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)) for _ in range(2)])
    x = torch.randn(64, 256, requires_grad=True)
    pager = ActivationPager(seq, [seq[0]], "cpu", min_bytes=1)
    pager.install()
    seq[1](seq[0](x)).sum().backward()
    # Each Linear saves its input and its weight: the two inputs of block 0 are paged, its weights
    # are not, and block 1 is not paged at all.
    assert pager.paged_tensors == 2
    assert pager.paged_bytes == 2 * 64 * 256 * 4
    paged = [p.grad.clone() for p in seq.parameters()] + [x.grad.clone()]
    pager.remove()
    for p in [*seq.parameters(), x]:
        p.grad = None
    seq[1](seq[0](x)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(paged, [p.grad for p in seq.parameters()] + [x.grad]))
    pager.install()
    with torch.no_grad():  # evaluation through a paged block: nothing is saved, nothing paged
        seq[1](seq[0](x))
    assert pager.paged_tensors == 2 and not pager.hook_ctx
    pager.remove()

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 8), nn.Linear(256, 8)

        def forward(self, z):
            return self.a(z) + self.b(z)

    two = nn.ModuleList([Twice(), Twice()])
    pager = ActivationPager(two, [two[0]], "cpu", min_bytes=1)
    pager.install()
    two[0](x * 2).sum().backward()
    assert pager.paged_tensors == 1  # x * 2, saved by both a and b, is paged once
    pager.remove()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("profile", [False, True])
def test_activation_pager_leaves_checkpointed_blocks_to_checkpointing(reentrant, profile):
    """A block under gradient checkpointing keeps only its inputs and is recomputed in backward:
    the pager (and the first step's profiler) leaves it alone, so it still runs twice a step and
    nothing of it is paged or counted; the block beside it, not checkpointed, is paged as before.
    Before, the pager's hooks over non-reentrant checkpointing's took every saved tensor it would
    have dropped (the block ran once) and, with reentrant checkpointing, paged the recompute's."""
    from torch.utils.checkpoint import checkpoint

    from trainstream.paging.activations import ActivationPager, ActivationProfiler

    torch.manual_seed(0)
    seq = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(2)])
    runs = [0, 0]
    for i, blk in enumerate(seq):
        blk.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    x = torch.randn(64, 256, requires_grad=True)

    def step():
        h = checkpoint(seq[0], x, use_reentrant=reentrant)
        seq[1](h).sum().backward()
        grads = [p.grad.clone() for p in seq.parameters()] + [x.grad.clone()]
        for p in [*seq.parameters(), x]:
            p.grad = None
        return grads

    plain = step()
    assert runs == [2, 1]  # checkpointing recomputes block 0
    pager = (ActivationProfiler(seq, list(seq), "cpu", min_bytes=1, page=True) if profile
             else ActivationPager(seq, list(seq), "cpu", min_bytes=1))
    pager.install()
    paged = step()
    pager.remove()
    assert runs == [4, 2]  # still recomputed under the pager
    assert all(torch.equal(a, b) for a, b in zip(plain, paged))
    # Block 1 alone is paged: its first Linear's input, the GELU's input and its output.
    assert pager.paged_tensors == 3 and pager.paged_bytes == 3 * 64 * 256 * 4
    if profile:
        assert pager.block_bytes == [0, 3 * 64 * 256 * 4]
    assert not pager.hook_ctx


def test_activation_pager_looks_at_the_models_parameters_at_its_first_and_last_block_and_keeps_outside_weights():
    from trainstream.paging.activations import ActivationPager

    class UsesHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, z, w):
            return self.lin(z) @ w  # saves lin's input and weight, its output and w (the head's)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(256, 256)
            self.blocks = nn.ModuleList([UsesHead() for _ in range(3)])

        def forward(self, z):
            for blk in self.blocks:
                z = blk(z, self.head.weight)
            return self.head(z)

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(64, 256)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads()
    pager = ActivationPager(model, [model.blocks[0], model.blocks[2]], "cpu", min_bytes=1)
    pager.install()
    got = grads()
    # Two paged blocks, each paging its Linear's input and output; their own weights and the
    # head's weight (outside the stack, saved inside the block) stay.
    assert pager.paged_tensors == 4
    assert pager.outside_looks == 2  # walks of the model's parameters: at the first and last paged block
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # replaced between steps
    assert all(torch.equal(a, b) for a, b in zip(grads(), want))
    assert pager.paged_tensors == 8 and pager.outside_looks == 4  # the new head is kept too
    pager.remove()


def test_activation_pager_keeps_strides_and_skips_sparse_views():
    from trainstream.paging.activations import ActivationPager

    pager = ActivationPager(nn.Linear(1, 1), [], "cpu", min_bytes=1)
    base = torch.randn(64, 48)
    dense_t = base.t() * 2                 # a transposed result: not contiguous, but dense
    page = pager.pack(dense_t)
    back = pager.unpack(page)
    assert back is not dense_t and back.stride() == dense_t.stride() and torch.equal(back, dense_t)
    view = base[:, :10]                    # leaves gaps in its storage: kept as it is
    assert pager.pack(view) is view
    small = ActivationPager(nn.Linear(1, 1), [], "cpu")  # 1 MiB threshold
    assert small.pack(base) is base


def test_activation_offload_options_are_checked(tsd):
    model = make_gpt(0)
    for bad, msg in ((1.5, "fraction must be in"), ([0, 7], "not in \\[0, 2\\)"), ("all", "activation_offload must be")):
        with pytest.raises(ValueError, match=msg):
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                             activation_offload=bad)
        assert trainstream.unwrap_session(model) is None
    flat = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        trainstream.wrap(flat, torch.optim.AdamW(flat.parameters()), device="cpu", socket=tsd.socket,
                         activation_offload=True)


class Gated(nn.Module):
    """A GPT with an extra head used only on some steps: its parameters get no gradient then."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT()
        self.aux = nn.Linear(64, 64)
        self.use_aux = True

    def forward(self, idx):
        out = self.gpt(idx)
        return self.aux(out) if self.use_aux else out


def test_frozen_and_gradless_parameters_follow_torch(tsd):
    torch.manual_seed(0)
    ref = Gated()
    ref.gpt.pos.weight.requires_grad_(False)  # frozen (e.g. a LoRA base): never sent to the daemon
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, weight_decay=0.1, **HP)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), weight_decay=0.1, **HP), device="cpu",
                                 socket=tsd.socket)
    session = trainstream.unwrap_session(mine)
    trainable = [p for p in mine.parameters() if p.requires_grad]
    assert len(session.params) == len(trainable)  # tied head/embedding once, the frozen one not at all
    assert all(ps.param is not mine.gpt.pos.weight for ps in session.params)
    frozen_before = mine.gpt.pos.weight.detach().clone()
    try:
        for step, t in enumerate(batches(8)):
            for model, o in ((ref, opt_ref), (mine, opt)):
                model.use_aux = step % 3 == 0  # aux gets a gradient on steps 0, 3, 6 only
                loss_of(model, t).backward()
                o.step()
                o.zero_grad()
        diff = max_diff(ref, mine)
        assert diff <= 1e-6, diff
        assert torch.equal(mine.gpt.pos.weight, frozen_before)
        sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
        assert sd["state"].keys() == sd_ref["state"].keys()
        aux_index = [i for i, p in enumerate(mine.parameters()) if p is mine.aux.weight][0]
        assert float(sd["state"][aux_index]["step"]) == float(sd_ref["state"][aux_index]["step"]) == 3
        assert (sd["state"][aux_index]["exp_avg"] - sd_ref["state"][aux_index]["exp_avg"]).abs().max() <= 1e-7
    finally:
        trainstream.unwrap(mine)


def test_state_dict_resumes_like_an_uninterrupted_run(tsd):
    steps, acc, clip = 20, 2, 0.5
    data = batches(steps * acc)
    ref, opt_ref, mine, opt = pair()
    del ref, opt_ref
    whole = copy.deepcopy(mine)
    whole, opt_whole = trainstream.wrap(whole, torch.optim.AdamW(param_groups(whole, 0.1, 3e-3), **HP), device="cpu",
                                        socket=tsd.socket, max_grad_norm=clip, accumulation_steps=acc)
    sched_whole = torch.optim.lr_scheduler.LambdaLR(opt_whole, schedule)
    a = train(whole, opt_whole, data, steps, acc, clip, sched_whole)
    trainstream.unwrap(whole)

    mine, opt = trainstream.wrap(mine, opt, device="cpu", socket=tsd.socket, max_grad_norm=clip, accumulation_steps=acc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    b1 = train(mine, opt, data[:10 * acc], 10, acc, clip, sched)
    saved = copy.deepcopy({"model": mine.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    trainstream.unwrap(mine)

    fresh = make_gpt(seed=123)  # other weights: everything must come from the checkpoint
    fresh.load_state_dict(saved["model"])
    fresh, opt2 = trainstream.wrap(fresh, torch.optim.AdamW(param_groups(fresh, 0.1, 3e-3), **HP), device="cpu",
                                   socket=tsd.socket, max_grad_norm=clip, accumulation_steps=acc)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, schedule)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    try:
        b2 = train(fresh, opt2, data[10 * acc:], 10, acc, clip, sched2)
        diff = max_diff(whole, fresh)
        print(f"resumed after 10 of 20 steps: max |param diff| vs uninterrupted = {diff:.3g}")
        assert diff == 0.0
        assert b1 + b2 == a
        # The checkpoint is torch.optim.AdamW's layout: stock AdamW loads it too.
        stock = make_gpt(seed=5)
        stock.load_state_dict(saved["model"])
        opt_stock = torch.optim.AdamW(param_groups(stock, 0.1, 3e-3), foreach=False, **HP)
        opt_stock.load_state_dict(saved["opt"])
        assert float(opt_stock.state_dict()["state"][0]["step"]) == 10
    finally:
        trainstream.unwrap(fresh)


def test_model_changed_outside_the_optimizer_resyncs_master(tsd):
    """model.load_state_dict() after wrap(): the daemon's masters follow the new weights."""
    ref, opt_ref, mine, opt = pair()
    other = make_gpt(seed=7)
    mine, opt = trainstream.wrap(mine, opt, device="cpu", socket=tsd.socket)
    try:
        ref.load_state_dict(other.state_dict())
        mine.load_state_dict(other.state_dict())
        data = batches(3)
        train(ref, opt_ref, data, 3, stock=True)
        train(mine, opt, data, 3)
        assert max_diff(ref, mine) <= 1e-6
    finally:
        trainstream.unwrap(mine)


def test_unsupported_and_wrong_uses_are_refused(tsd):
    model = make_gpt()
    with pytest.raises(trainstream.InvalidRequest, match="amsgrad"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True), device="cpu", socket=tsd.socket)
    with pytest.raises(trainstream.InvalidRequest, match="maximize"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters(), maximize=True), device="cpu", socket=tsd.socket)
    with pytest.raises(TypeError, match="AdamW"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", socket=tsd.socket)
    with pytest.raises(TypeError, match="unknown options"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket, bogus=1)
    with pytest.raises(ValueError, match="param_offload"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         param_offload="all")
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0  # refusals leave no job behind

    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket)
    try:
        t = batches(2)
        loss_of(model, t[0]).backward()
        with pytest.raises(RuntimeError, match="accumulation_steps"):
            loss_of(model, t[1]).backward()  # a second backward without accumulation_steps
    finally:
        trainstream.unwrap(model)
    with pytest.raises(TsdError_ := trainstream.TsdError, match="unwrapped"):
        opt.step()
    del TsdError_


def test_hyperparameters_changed_between_backward_and_step_are_reported(tsd):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket)
    try:
        loss_of(model, batches(1)[0]).backward()
        opt.param_groups[0]["lr"] = 5e-3
        with pytest.raises(RuntimeError, match="changed between backward and step"):
            opt.step()
    finally:
        trainstream.unwrap(model)


def test_check_memory_explains_and_moment_dtype_auto_falls_back_to_bf16(tsd):
    model = make_gpt(d=64, layers=4)
    # What tsd would charge, from the daemon's dry run of the registration (nothing allocated).
    need32 = trainstream.plan_wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                   moment_dtype="float32").state_bytes
    plan16 = trainstream.plan_wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                   moment_dtype="bfloat16")
    need16 = plan16.state_bytes
    assert need16 < need32 and plan16.moment_dtype == "bfloat16"
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0  # plan_wrap() created no job
    with pytest.raises(trainstream.QuotaExceeded) as e:
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         quota=need16 - 4096)
    msg = str(e.value)
    assert "needs" in msg and "available" in msg and "pool" in msg and isinstance(e.value, MemoryError)
    assert "fp32 master weights" in msg and "moments" in msg  # each part named with its size
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  quota=(need16 + need32) // 2)
    try:
        assert opt.moment_dtype == "bfloat16"
        session = trainstream.unwrap_session(model)
        assert session.state_bytes == need16  # the dry run's figure is what the registration charged
        train(model, opt, batches(2), 2)
    finally:
        trainstream.unwrap(model)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  quota=need32)
    assert opt.moment_dtype == "float32"
    trainstream.unwrap(model)


def test_bf16_moments_train_close_to_fp32(tsd):
    ref, opt_ref, mine, opt = run_both(tsd, 10, moment_dtype="bfloat16")[:4]
    diff = max_diff(ref, mine)
    print(f"bf16 moments (stochastic rounding), 10 steps: max |param diff| = {diff:.3g}")
    assert diff <= 5e-3


def test_unwrap_releases_the_job_and_keeps_the_weights(tsd):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket,
                                  job="unwrap-me")
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.jobs()[0].name == "unwrap-me" and c.jobs()[0].used_bytes > 0
        train(model, opt, batches(2), 2)
        after = [p.detach().clone() for p in model.parameters()]
        assert trainstream.unwrap(model) is model
        assert "unwrap-me" not in [j.name for j in c.jobs()]
        assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
        assert trainstream.unwrap_session(model) is None
        loss_of(model, batches(1)[0]).backward()  # a plain model again: gradients stay in .grad
        assert all(p.grad is not None for p in model.parameters())


# A budget that gives the CPU device memory to spare: offload="auto" then switches on the CPU too.
ROOMY = trainstream.Budget(vram_usable=1 << 40)


def test_offload_auto_switches_to_stock_adamw_when_it_fits(tsd):
    """The switch itself (state moved out of the daemon into torch.optim.AdamW, the job released),
    on the CPU with a budget that says stock AdamW fits: the run must still equal stock AdamW
    throughout."""
    ref, opt_ref, mine, opt, a, b = run_both(tsd, 8, 2, 0.5, offload="auto", job="auto-switch", budget=ROOMY)
    assert not opt.offloading
    assert max_diff(ref, mine) <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    with trainstream.connect(socket=tsd.socket) as c:
        assert "auto-switch" not in [j.name for j in c.jobs()]


def test_offload_auto_switch_gives_param_dtype_models_their_fp32_weights_back(tsd):
    """With param_dtype=bf16, the switch to stock AdamW restores the fp32 parameters from the
    masters, so stock AdamW steps the model in fp32, as the user made it. The masters to expect
    come from the same run without the switch (offload=True)."""
    data = batches(4)

    def start(**kw):
        model = make_gpt(0)
        opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, param_dtype=torch.bfloat16,
                                      activation_offload=True, **kw)
        trainstream.unwrap_session(model).act_pager.min_bytes = 1024
        return model, opt

    kept, kept_opt = start(offload=True)
    try:
        train(kept, kept_opt, data[:2], 2)
        sd = kept_opt.state_dict()
        order = [p for g in kept_opt.param_groups for p in g["params"]]
        name_of = {id(p): n for n, p in kept.named_parameters()}
        masters = {name_of[id(p)]: sd["state"][i]["master"] for i, p in enumerate(order)}
    finally:
        trainstream.unwrap(kept)

    model, opt = start(offload="auto", budget=ROOMY)
    session = trainstream.unwrap_session(model)
    train(model, opt, data[:2], 2)  # the switch comes at the end of the second step
    assert not opt.offloading
    assert any("switched to stock" in e for e in session.events)
    # wrap()'s line says where its time went
    line = next(e for e in session.events if e.startswith("wrap: "))
    assert re.search(r"; took [0-9.]+ s \(plan [0-9.]+, registration in tsd [0-9.]+, parameters into tsd [0-9.]+", line)
    # Activation paging stays on after the switch: the fit check measured the peak with it.
    assert session.act_pager is not None and session.act_pager.handles
    paged_before = session.act_pager.paged_bytes
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p.detach(), masters[n]) for n, p in model.named_parameters())
    losses = train(model, opt, data[2:], 2)  # stock AdamW on the fp32 parameters from here
    assert all(math.isfinite(x) for x in losses)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert session.act_pager.paged_bytes > paged_before
    pager = session.act_pager
    trainstream.unwrap(model)
    assert session.act_pager is None and not pager.handles


def test_offload_auto_keeps_offloading_when_it_does_not_fit(tsd):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket)
    try:
        train(model, opt, batches(3), 3)
        assert opt.offloading
        assert any("keeps offloading" in e for e in trainstream.unwrap_session(model).events)
    finally:
        trainstream.unwrap(model)


def test_fractional_accumulation_steps_are_refused(tsd):
    model = make_gpt()
    for bad in (2.5, "2", True, 0):
        with pytest.raises(ValueError, match="accumulation_steps must be a whole number"):
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                             accumulation_steps=bad)
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0  # nothing was created


def test_bad_hyperparameters_are_refused_before_they_reach_tsd(tsd):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket)
    try:
        t = batches(2)
        for key, value, says in (("lr", float("nan"), "lr = nan"), ("lr", -1.0, "lr = -1.0"),
                                 ("eps", 0.0, "eps = 0.0"), ("betas", (1.0, 0.95), r"betas\[0\] = 1.0"),
                                 ("weight_decay", float("inf"), "weight_decay = inf")):
            good = opt.param_groups[0][key]
            opt.param_groups[0][key] = value
            with pytest.raises(ValueError, match=r"param_groups\[0\]: " + says):
                loss_of(model, t[0]).backward()
            opt.param_groups[0][key] = good
            for p in model.parameters():
                p.grad = None
        # The optimizer in tsd was never touched: training goes on.
        loss_of(model, t[1]).backward()
        opt.step()
        opt.zero_grad()
    finally:
        trainstream.unwrap(model)
