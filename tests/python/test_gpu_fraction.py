"""wrap(optimizer_gpu_fraction=...): part of the optimizer on the model's device (torch's AdamW over
fp32 masters), the rest in tsd. Every fraction must give what the all-tsd run and stock
torch.optim.AdamW + clip_grad_norm_ give (within 1e-6, fp32): clipping by the global norm over
both shares, accumulation, schedulers, state_dict round trips, unwrap(), overlap_forward and the
switch of offload="auto". The device is the CPU here (the share uses the plain torch AdamW); the
CUDA variant at the end runs on a GPU machine (fused AdamW) and skips elsewhere."""
import copy

import pytest
import torch

import trainstream
from trainstream.blockplan import MARGIN
from gpt import batches, loss_of, make_gpt, max_diff, param_groups, train
from test_wrap_cpu import HP, schedule

pytestmark = pytest.mark.usefixtures("one_thread")

FRACTIONS = [0.0, 0.3, 0.5, 1.0]
CONFIGS = [(1, None), (1, 0.05), (2, 0.05)]  # (accumulation, max_grad_norm): 0.05 bites every step


def stock_run(steps, accumulation, max_grad_norm, device="cpu"):
    ref = make_gpt().to(device)
    opt = torch.optim.AdamW(param_groups(ref, 0.1, 3e-3), foreach=False, **HP)
    data = batches(steps * accumulation, device=device)
    losses = train(ref, opt, data, steps, accumulation, max_grad_norm, torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                   stock=True)
    return ref, opt, losses


def wrapped(tsd, device="cpu", **kw):
    model = make_gpt().to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    kw.setdefault("offload", True)
    return trainstream.wrap(model, opt, device=device, socket=tsd.socket, **kw)


def tsd_run(tsd, steps, accumulation, max_grad_norm, device="cpu", after=None, **kw):
    """`steps` wrapped steps; returns (model, losses, state_dict, session events, the share's tensors
    and parameters, last_grad_norm); `after(model, opt)` runs before unwrap()."""
    model, opt = wrapped(tsd, device, max_grad_norm=max_grad_norm, accumulation_steps=accumulation, **kw)
    s = trainstream.unwrap_session(model)
    try:
        data = batches(steps * accumulation, device=device)
        losses = train(model, opt, data, steps, accumulation, max_grad_norm,
                       torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        share = (len(s.share), s.share.numel) if s.share is not None else (0, 0)  # "auto" chose it after step 1
        sd = opt.state_dict()
        norm = opt.last_grad_norm
        if after is not None:
            after(model, opt)
        return model, losses, sd, list(s.events), share, norm
    finally:
        trainstream.unwrap(model)


def total_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.fixture(scope="module")
def all_tsd(tsd):
    """The all-tsd runs (fraction 0), one per configuration."""
    return {cfg: tsd_run(tsd, 20, *cfg) for cfg in CONFIGS}


@pytest.mark.parametrize("accumulation,max_grad_norm", CONFIGS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_fraction_equals_all_tsd_and_torch_adamw(tsd, all_tsd, fraction, accumulation, max_grad_norm):
    """20 fp32 steps, two groups with their own lr, a scheduler, tied weights; clipping at 0.05
    bites every step, so the global norm over both shares decides every update."""
    ref, opt_ref, a = stock_run(20, accumulation, max_grad_norm)
    mine, b, sd, events, (tensors, numel), norm = tsd_run(tsd, 20, accumulation, max_grad_norm,
                                                          optimizer_gpu_fraction=fraction)
    base = all_tsd[(accumulation, max_grad_norm)][0]
    total = total_params(ref)
    if fraction == 0.0:
        assert tensors == 0
    elif fraction == 1.0:
        assert numel == total and any("no optimizer in tsd" in e for e in events)
    else:
        assert 0 < numel < total and abs(numel / total - fraction) < 0.2, (numel, total)
    vs_torch, vs_tsd = max_diff(ref, mine), max_diff(base, mine)
    print(f"fraction={fraction} acc={accumulation} clip={max_grad_norm}: {numel}/{total} parameters on the device; "
          f"max |diff| vs torch {vs_torch:.3g}, vs all-tsd {vs_tsd:.3g}")
    assert vs_torch <= 1e-6 and vs_tsd <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    assert a[-1] < a[0]
    # The state, in torch's layout, for every parameter whichever share holds it.
    sd_ref = opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert float(sd["state"][i]["step"]) == float(st["step"]) == 20
        for k in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][i][k].float() - st[k]).abs().max().item() <= 1e-6 * max(1.0, st[k].abs().max().item())
    if max_grad_norm:  # the global norm, over both shares, of the last step's gradients
        assert norm is not None and norm > max_grad_norm


def test_share_takes_the_parameters_that_finish_last(tsd):
    """The share starts with the parameters registered first (embeddings, first block): backward
    finishes their gradients last."""
    model, opt = wrapped(tsd, optimizer_gpu_fraction=0.3)
    try:
        s = trainstream.unwrap_session(model)
        on_device = {id(e.param) for e in s.share.entries}
        names = {id(p): n for n, p in model.named_parameters()}
        assert id(model.tok.weight) in on_device and id(model.pos.weight) in on_device
        assert id(model.blocks[1].out.weight) not in on_device and id(model.ln.weight) not in on_device
        # tsd got only the rest, and a norm bucket only with clipping.
        assert s.handle.num_buckets == len(s.params) and s.norm_bucket is None
        assert not set(on_device) & {id(ps.param) for ps in s.params}
        print("on the device:", sorted(names[i] for i in on_device))
    finally:
        trainstream.unwrap(model)


def test_auto_passes_over_a_tensor_too_large_only_when_deciding_alone():
    """"auto" from a measured step (one rank) passes over a first candidate larger than the room
    (a tied embedding) and takes the next ones that fit; the prefix form (data parallel's ranks
    agreeing on a count) stops there, so `limit` keeps a prefix."""
    from trainstream import gpushare
    # Backward order: blocks last to first, the embedding registered first (finishes last).
    emb, b0, b1, b2 = (torch.zeros(n) for n in (4000, 100, 100, 100))
    trainable = [(b2, 4), (b1, 4), (b0, 4), (emb, 4)]
    room = 3 * gpushare.vram_cost(100, 4) + 1
    alone = gpushare.choose("auto", trainable, room, prefix=False)
    assert alone.ids == frozenset({id(b0), id(b1), id(b2)}) and alone.numel == 300
    assert "passed over 1 tensors" in alone.why and alone.passed == 1
    two = gpushare.choose("auto", trainable, 2 * gpushare.vram_cost(100, 4), prefix=False)
    assert two.ids == frozenset({id(b0), id(b1)})  # the earliest to finish stays in tsd
    ranked = gpushare.choose("auto", trainable, room)
    assert ranked.ids == frozenset() and ranked.numel == 0 and "passed over" not in ranked.why
    # A room for nothing passes over everything and says nothing about it.
    none = gpushare.choose("auto", trainable, 10, prefix=False)
    assert none.ids == frozenset() and "passed over" not in none.why


def half_budget(model):
    """A VRAM budget whose room (less blockplan.MARGIN) holds about half of the parameters' share
    costs (fp32 working copies: 12 bytes each, moments and gradient) on a CPU device, where the
    measured peak is 0."""
    return trainstream.Budget(vram_usable=int(6 * total_params(model) / (1 - MARGIN)))


def test_auto_is_not_guessed_at_wrap(tsd):
    """"auto" puts nothing on the device at wrap() (the activations are unknown): the plan says
    so; on a CPU device without a VRAM budget, the first step keeps everything in tsd."""
    model = make_gpt()
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    kw = dict(device="cpu", socket=tsd.socket, optimizer_gpu_fraction="auto")
    plan = trainstream.plan_wrap(model, opt, budget=trainstream.Budget(vram_usable=1 << 40), **kw)
    assert plan.gpu_share.numel == 0 and plan.demand.gpu_optimizer == 0
    assert "after the first step" in plan.gpu_share.why
    mine, _, _, events, (tensors, _), _ = tsd_run(tsd, 3, 1, 0.05, optimizer_gpu_fraction="auto")
    assert tensors == 0 and any("no VRAM budget" in e for e in events)


@pytest.mark.parametrize("accumulation,max_grad_norm", CONFIGS)
@pytest.mark.parametrize("overlap", [False, True])
def test_auto_moves_what_fits_after_the_first_step(tsd, all_tsd, accumulation, max_grad_norm, overlap):
    """After the first step, "auto" moves the last-finishing parameters that fit in the room the
    step left (here half of them) into the share, with tsd's state; the 20 steps still equal
    torch's and the all-tsd run's (within 1e-6), the state_dict holds every parameter."""
    ref, opt_ref, a = stock_run(20, accumulation, max_grad_norm)
    seen = {}

    def check(model, opt):
        s = trainstream.unwrap_session(model)
        seen["moved"] = len(s.moved)
        seen["tok"] = id(model.tok.weight) in s.share.by_param
        seen["tsd"] = opt.offloading and all(id(e.param) not in s.by_param for e in s.share.entries)
        # What the job's regions span less what the pool charges it: what tsd returned.
        with trainstream.connect(socket=tsd.socket) as c:
            used = next(j.used_bytes for j in c.jobs() if j.name == job)
        seen["returned"] = (sum(r.size for r in s.client.regions()) - used, s.retired_bytes)
    job = f"auto-moves-{accumulation}-{max_grad_norm}-{overlap}"
    mine, b, sd, events, (tensors, numel), norm = tsd_run(
        tsd, 20, accumulation, max_grad_norm, optimizer_gpu_fraction="auto", budget=half_budget(ref),
        overlap_forward=overlap, after=check, job=job)
    charged_less, said = seen.pop("returned")
    # tsd retired the moved buckets: their fp32 moments (8 bytes a parameter) and, with
    # accumulation, their fp32 accumulator (4 more) went back to the pool, less the partial pages
    # at the ends of the moved span in each region (they are one span: the last registered).
    assert sum("tsd retired the" in e and f"the {tensors} moved buckets" in e for e in events) == 1, events
    per_param = 8 + (4 if accumulation > 1 else 0)
    regions = 3 if accumulation > 1 else 2
    assert charged_less == said and numel * per_param - 2 * regions * 4096 <= said <= numel * per_param
    total = total_params(ref)
    print(f"auto acc={accumulation} clip={max_grad_norm} overlap={overlap}: {numel}/{total} moved; "
          f"{[e for e in events if 'after step' in e]}")
    assert 0.2 < numel / total < 0.8 and seen == {"moved": tensors, "tok": True, "tsd": True}
    assert any("optimizer_gpu_fraction=auto after step 1" in e and "moved" in e for e in events)
    assert max_diff(ref, mine) <= 1e-6 and max_diff(all_tsd[(accumulation, max_grad_norm)][0], mine) <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    sd_ref = opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert float(sd["state"][i]["step"]) == 20
        for k in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][i][k].float() - st[k]).abs().max().item() <= 1e-6 * max(1.0, st[k].abs().max().item())
    if max_grad_norm:
        assert norm is not None and norm > max_grad_norm


def test_auto_with_room_for_everything_releases_the_job(tsd):
    """Room for every parameter: after the first step the share takes everything (offload="auto"'s
    switch) and the job's memory in tsd goes."""
    ref, _, a = stock_run(6, 1, 0.05)

    def check(model, opt):
        assert not opt.offloading and trainstream.unwrap_session(model).handle is None
    mine, b, _, events, (_, numel), _ = tsd_run(tsd, 6, 1, 0.05, optimizer_gpu_fraction="auto", job="auto-all",
                                               budget=trainstream.Budget(vram_usable=1 << 40), after=check)
    assert numel == total_params(ref) and any("every parameter's optimizer fits" in e for e in events)
    assert max_diff(ref, mine) <= 1e-6
    with trainstream.connect(socket=tsd.socket) as c:
        assert "auto-all" not in [j.name for j in c.jobs()]


def test_auto_state_dict_round_trips_after_the_move(tsd):
    """After the move, load_state_dict (its own state, mid-run: tsd's part and the moved
    parameters') and a fresh "auto" run resumed from it both continue as the stock run."""
    ref, _, _ = stock_run(10, 1, 0.05)
    kw = dict(optimizer_gpu_fraction="auto", budget=half_budget(ref))

    def mid(model, opt):
        assert trainstream.unwrap_session(model).moved
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state: nothing changes
    again, session = stop_and_resume(tsd, kw, kw, mid)
    assert session.moved  # the resumed run moved its share after its own first step
    assert max_diff(ref, again) <= 1e-6


def test_auto_with_param_dtype_gives_fp32_back(tsd):
    """param_dtype=bf16: the moved parameters stay bf16 working copies of fp32 masters (now on the
    device); unwrap() gives every parameter back in fp32, close to the all-tsd run's."""
    ref = make_gpt()
    dtypes = {}

    def keep(model, opt):
        dtypes["during"] = {p.dtype for p in model.parameters()}
        s = trainstream.unwrap_session(model)
        dtypes["returned"] = s.retired_bytes
        moved = sorted(s.moved)  # bucket indices; "auto" may pass over one too large for the room
        dtypes["spans"] = 1 + sum(1 for a, b in zip(moved, moved[1:]) if b != a + 1)
    base, *_ = tsd_run(tsd, 6, 2, 1.0, param_dtype=torch.bfloat16)
    mine, _, _, _, (tensors, numel), _ = tsd_run(tsd, 6, 2, 1.0, param_dtype=torch.bfloat16,
                                                 optimizer_gpu_fraction="auto", budget=half_budget(ref), after=keep)
    assert tensors > 0 and dtypes["during"] == {torch.bfloat16}
    # The masters are not the parameter slots here: tsd returned them with the moments and the
    # accumulator (4 + 8 + 4 bytes a parameter), less partial pages at the ends of each region's
    # spans (one span per run of consecutive buckets moved).
    assert numel * 16 - dtypes["spans"] * 2 * 4 * 4096 <= dtypes["returned"] <= numel * 16
    assert all(p.dtype == torch.float32 for p in mine.parameters())
    assert max_diff(base, mine) <= 2e-3


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "half", "AUTO", True, None, [0.5]])
def test_bad_fractions_are_refused_before_anything_happens(tsd, bad):
    model = make_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), **HP)
    with pytest.raises(ValueError, match="optimizer_gpu_fraction must be 'auto' or a number in \\[0, 1\\]"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, job="bad-fraction", optimizer_gpu_fraction=bad)
    assert trainstream.unwrap_session(model) is None
    assert all(torch.equal(x, p) for x, p in zip(before, model.parameters()))
    with trainstream.connect(socket=tsd.socket) as c:
        assert "bad-fraction" not in [j.name for j in c.jobs()]


def test_a_share_is_refused_with_kept_jobs(tsd):
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), **HP)
    for kw in (dict(keep_for="1m"), dict(keep_for="1m", resume=True)):
        with pytest.raises(ValueError, match="optimizer_gpu_fraction=0 with resume= or keep_for="):
            trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, job="kept", optimizer_gpu_fraction=0.5, **kw)


def stop_and_resume(tsd, first, second, mid=None):
    """10 steps clipped at 0.05, stopped after 5: a run wrapped with options `first` (`mid(model,
    opt)` after its third step) gives its state_dict, weights and schedule to a fresh run wrapped
    with `second`, which takes the other 5 and checks every step count; returns its model and
    its (unwrapped) session."""
    data = batches(10)
    model, opt = wrapped(tsd, max_grad_norm=0.05, **first)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    try:
        train(model, opt, data[:3], 3, 1, 0.05, sched)
        if mid is not None:
            mid(model, opt)
        train(model, opt, data[3:5], 2, 1, 0.05, sched)
        sd = copy.deepcopy(opt.state_dict())
        weights = copy.deepcopy(model.state_dict())
        sched_sd = sched.state_dict()
    finally:
        trainstream.unwrap(model)
    again = make_gpt(seed=7)
    again.load_state_dict(weights)
    opt2 = torch.optim.AdamW(param_groups(again, 0.1, 3e-3), **HP)
    again, opt2 = trainstream.wrap(again, opt2, device="cpu", socket=tsd.socket, offload=True, max_grad_norm=0.05,
                                   **second)
    session = trainstream.unwrap_session(again)
    try:
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, schedule)
        opt2.load_state_dict(sd)  # after the scheduler's creation (which sets lr), as in torch
        sched2.load_state_dict(sched_sd)
        train(again, opt2, data[5:], 5, 1, 0.05, sched2)
        st = opt2.state_dict()["state"]
        assert all(float(v["step"]) == 10 for v in st.values())
    finally:
        trainstream.unwrap(again)
    return again, session


@pytest.mark.parametrize("first,second", [(0.5, 0.5), (0.5, 0.0), (0.3, 1.0), (1.0, 0.3)])
def test_state_dict_round_trip_across_fractions(tsd, first, second):
    """10 steps stopped after 5: the state_dict of a run with one fraction loads into a run with
    another (torch's layout for both shares), and the result equals the uninterrupted stock run."""
    ref, _, _ = stock_run(10, 1, 0.05)
    again, _ = stop_and_resume(tsd, dict(optimizer_gpu_fraction=first), dict(optimizer_gpu_fraction=second))
    assert max_diff(ref, again) <= 1e-6


def test_load_state_dict_refuses_a_bad_share_entry_and_changes_nothing(tsd):
    model, opt = wrapped(tsd, optimizer_gpu_fraction=0.5)
    try:
        train(model, opt, batches(2), 2)
        sd = copy.deepcopy(opt.state_dict())
        s = trainstream.unwrap_session(model)
        i = [id(p) for g in opt.param_groups for p in g["params"]].index(id(s.share.entries[0].param))
        sd["state"][i]["exp_avg"] = sd["state"][i]["exp_avg"].reshape(-1)[:3]
        before = {k: v.clone() for k, v in s.share.state_of(s.share.entries[0].param).items()}
        with pytest.raises(ValueError, match=f"state\\[{i}\\]"):
            opt.load_state_dict(sd)
        after = s.share.state_of(s.share.entries[0].param)
        assert all(torch.equal(before[k], after[k]) for k in before)
        with pytest.raises(RuntimeError, match="GPU share"):
            opt.save_state(0)
    finally:
        trainstream.unwrap(model)


def test_param_dtype_share_keeps_fp32_masters_and_unwrap_gives_them_back(tsd):
    """param_dtype=bf16: the share's parameters train as bf16 working copies of fp32 masters on
    the device (as tsd's do), equal to the all-tsd run's masters; unwrap() gives fp32 back."""
    def run(fraction):
        out = {}

        def keep(model, opt):
            out["sd"] = opt.state_dict()
            out["dtypes"] = {p.dtype for p in model.parameters()}
        model, *_ = tsd_run(tsd, 10, 2, 1.0, param_dtype=torch.bfloat16, optimizer_gpu_fraction=fraction, after=keep)
        return model, out

    base, a = run(0.0)
    mine, b = run(0.5)
    assert a["dtypes"] == b["dtypes"] == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in mine.parameters())
    # Two correct AdamWs differ in the last bit now and then, which can flip a bf16 rounding of a
    # working copy and its gradients: the tolerances test_wrap_cpu's bf16 tests state.
    for i, st in a["sd"]["state"].items():
        assert (b["sd"]["state"][i]["master"] - st["master"]).abs().max().item() <= 5e-4
    assert max_diff(base, mine) <= 2e-3


def test_overlap_forward_with_a_share(tsd):
    """overlap_forward with clipping: tsd's share finishes during the next forward, the norm bucket
    first; the share updates at step()."""
    ref, _, a = stock_run(10, 1, 0.05)
    mine, b, *_ = tsd_run(tsd, 10, 1, 0.05, overlap_forward=True, optimizer_gpu_fraction=0.5)
    assert max_diff(ref, mine) <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)


def test_offload_auto_switch_goes_through_the_share(tsd):
    """The switch of offload="auto" is the share taking everything: from 0.3 it grows to all of
    the parameters after the second step, the job goes, and the run still equals torch."""
    ref, _, a = stock_run(8, 2, 0.5)

    def check(model, opt):
        s = trainstream.unwrap_session(model)
        assert not opt.offloading and s.handle is None
        assert s.share.numel == total_params(model)
        assert any("switched to stock" in e for e in s.events)
        assert opt.state is s.share.inner.state and len(opt.state) == len(s.share.entries)
    mine, b, sd, *_ = tsd_run(tsd, 8, 2, 0.5, offload="auto", budget=trainstream.Budget(vram_usable=1 << 40),
                              optimizer_gpu_fraction=0.3, job="switch-share", after=check)
    assert max_diff(ref, mine) <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    with trainstream.connect(socket=tsd.socket) as c:
        assert "switch-share" not in [j.name for j in c.jobs()]


def test_last_grad_norm_is_the_global_norm(tsd):
    """With a share, tsd's norm includes the share's part: it equals clip_grad_norm_'s over all."""
    ref = make_gpt()
    data = batches(1)
    loss_of(ref, data[0]).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    for fraction in (0.0, 0.5, 1.0):
        model, opt = wrapped(tsd, max_grad_norm=1.0, optimizer_gpu_fraction=fraction)
        try:
            loss_of(model, data[0]).backward()
            opt.step()
            assert opt.last_grad_norm == pytest.approx(want, rel=1e-6), fraction
        finally:
            trainstream.unwrap(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accumulation,max_grad_norm", [(1, None), (2, 0.05)])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0, "auto"])
def test_cuda_share_uses_fused_adamw_and_equals_torch(tsd, fraction, accumulation, max_grad_norm):
    ref, _, a = stock_run(20, accumulation, max_grad_norm, device="cuda")

    def check(model, opt):
        s = trainstream.unwrap_session(model)
        if s.share is not None:
            assert all(e.master.is_cuda for e in s.share.entries)
            assert s.share.inner.param_groups[0]["fused"]
    # With the default param_offload="auto" every block may be paged (its only copy is then its tsd
    # slot), so the share leaves the blocks in tsd; without weight paging "auto" takes everything.
    paging = {"param_offload": False} if fraction == "auto" and accumulation == 1 else {}
    mine, b, _, events, (_, numel), _ = tsd_run(tsd, 20, accumulation, max_grad_norm, device="cuda",
                                                optimizer_gpu_fraction=fraction, after=check, **paging)
    print(f"cuda fraction={fraction}: {numel} parameters on the device; max |diff| vs torch {max_diff(ref, mine):.3g}")
    if fraction == "auto" and paging:
        assert numel == total_params(ref)  # a small model: everything fits
    elif fraction == "auto":
        outside = {id(p) for p in ref.parameters()} - {id(p) for p in ref.blocks.parameters()}
        assert numel == sum(p.numel() for p in ref.parameters() if id(p) in outside)
    assert max_diff(ref, mine) <= 1e-6
    assert b == pytest.approx(a, rel=1e-5)
    assert all(p.is_cuda for p in mine.parameters())


def test_bad_hyperparameters_are_refused_for_the_share_too(tsd):
    """A scheduler that makes lr negative: refused with the group named, on the share's path
    (everything on the device) as on tsd's."""
    model, opt = wrapped(tsd, optimizer_gpu_fraction=1.0)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, batches(1)[0]).backward()
        opt.param_groups[1]["lr"] = -1.0
        with pytest.raises(ValueError, match="param_groups\\[1\\]: lr = -1.0"):
            opt.step()
        assert all(torch.equal(x, p) for x, p in zip(before, model.parameters()))
    finally:
        trainstream.unwrap(model)


def test_partial_state_read_is_what_the_whole_snapshot_holds(tsd):
    """read_state(buckets) (how "auto" takes the moved parameters' state) asks the daemon for just
    those buckets: the same tensors as the whole snapshot's; a bad list is refused with what was
    wrong, and the session goes on."""
    model, opt = wrapped(tsd, max_grad_norm=0.05)
    try:
        train(model, opt, batches(2), 2)
        s = trainstream.unwrap_session(model)
        whole, part = s.read_state(), s.read_state([0, 2])
        assert sorted(part) == [0, 2]
        for b in part:
            assert all(torch.equal(x, y) for x, y in zip(whole[b][:3], part[b][:3])) and whole[b][3] == part[b][3] == 2
        with pytest.raises(trainstream.TsdError, match="strictly ascending"):
            s.read_state([2, 0])
        with pytest.raises(trainstream.TsdError, match=f"bucket {len(s.params) + 1} does not exist"):
            s.read_state([len(s.params) + 1])
        train(model, opt, batches(1), 1)
    finally:
        trainstream.unwrap(model)
