"""wrap(overlap_forward=True): updates finish during the next forward. Every run here is compared
bit for bit with the same run with overlap_forward=False (step() waits for every update and copies
it back): losses, parameters, state dicts read mid-run, the weights unwrap() gives back right after
step(). On CPU in CI; the CUDA variants skip without a GPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainstream
from gpt import batches, loss_of, make_gpt, param_groups

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def schedule(step):
    return min(1.0, (step + 1) / 4) * 0.95 ** step  # a new lr every step, set right after step()


def grad_norms(steps, accumulation, seed=0):
    """The global gradient norms of a stock, unclipped run (to pick a limit that bites on some steps)."""
    model = make_gpt(seed)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), foreach=False, **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # the runs' schedule: the same path until a clip
    data = batches(steps * accumulation)
    out = []
    for s in range(steps):
        for k in range(accumulation):
            (loss_of(model, data[s * accumulation + k]) / accumulation).backward()
        out.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
    return out


def run(tsd, overlap, device="cpu", steps=10, accumulation=1, max_grad_norm=None, snapshot_at=None,
        unwrap_after=None, model=None, loss_fn=loss_of, compile=None, **wrap_kw):
    """Trains a small GPT (tied head and embedding, two groups, a scheduler stepped right after
    step()). Returns losses, final parameters, the norms tsd clipped by, and at step `snapshot_at`
    the model's and the optimizer's state dicts read right after step(). `compile`: "before" or
    "after" wrap(), model.compile()."""
    model = copy.deepcopy(model) if model is not None else make_gpt(0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    wrap_kw.setdefault("offload", True)  # on CUDA, "auto" would hand a model this small to stock AdamW after 2 steps
    if compile == "before":
        model.compile()
    model, opt = trainstream.wrap(model, opt, device=device, socket=tsd.socket, max_grad_norm=max_grad_norm,
                                  accumulation_steps=accumulation, overlap_forward=overlap, **wrap_kw)
    if compile == "after":
        model.compile()
    session = trainstream.unwrap_session(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = [t.to(device) for t in batches(steps * accumulation)]
    losses, norms, snap, pending = [], [], None, []
    try:
        for s in range(steps):
            total = 0.0
            for k in range(accumulation):
                loss = loss_fn(model, data[s * accumulation + k]) / accumulation
                loss.backward()
                total += loss.item()
            opt.step()
            pending.append(len(session.waits.pending))
            if s == snapshot_at:
                msd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                osd = opt.state_dict()
                snap = (msd, {i: {k: v.clone() for k, v in st.items()} for i, st in osd["state"].items()})
            sched.step()
            opt.zero_grad()
            if max_grad_norm:
                norms.append(opt.last_grad_norm)
            losses.append(total)
            if unwrap_after is not None and s == unwrap_after:
                break
    finally:
        events = list(session.events)
        trainstream.unwrap(model)
    params = [p.detach().cpu().clone() for p in model.parameters()]
    return dict(losses=losses, params=params, norms=norms, snap=snap, pending=pending, events=events)


def assert_same(a, b):
    assert a["losses"] == b["losses"]
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [None, "some", "every"])
def test_overlap_is_bit_identical(tsd, device, accumulation, clip):
    """10 steps, tied weights, a scheduler right after step(), clipping that bites on some steps and
    not others (or on every one), accumulation; state dicts read right after step 4."""
    limit = None
    if clip == "some":
        norms = sorted(grad_norms(10, accumulation))
        limit = (norms[3] + norms[4]) / 2  # between the 4th and 5th smallest: bites on 6 of 10 steps
    elif clip == "every":
        limit = 1e-3
    off = run(tsd, False, device, accumulation=accumulation, max_grad_norm=limit, snapshot_at=4)
    on = run(tsd, True, device, accumulation=accumulation, max_grad_norm=limit, snapshot_at=4)
    assert_same(on, off)
    assert max(on["pending"][1:]) > 0, "overlap_forward=True deferred nothing"
    assert max(off["pending"]) == 0
    if clip == "some":
        bit = sum(n > limit for n in on["norms"])
        assert 0 < bit < 10, on["norms"]
        assert on["norms"] == off["norms"]
    for (ma, oa), (mb, ob) in [(on["snap"], off["snap"])]:
        assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
        assert oa.keys() == ob.keys()
        for i in oa:
            for k in ("exp_avg", "exp_avg_sq", "master", "step"):
                assert torch.equal(oa[i][k], ob[i][k]), (i, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [None, "every"])
def test_overlap_with_paged_weights_defers_their_updates_too(tsd, device, clip, monkeypatch):
    """param_offload: a paged block's weights are copied from their parameter slots, so their
    updates are waited for where the pager copies the block (its prefetch in the next forward),
    not in step(): the step defers them too, no block is copied while one of its updates is still
    owed, and the run equals the one without overlap bit for bit (10 steps, state dicts read
    right after step 4)."""
    from trainstream.paging.weights import WeightPager
    prefetch, copied_owed = WeightPager._prefetch, []

    def checked(self, b):
        was_loaded = b.loaded
        prefetch(self, b)
        owed = [w.slots.bucket for w in b.weights if w.slots is not None and w.slots.bucket in self.session.waits.pending]
        if b.paged and not was_loaded and owed:
            copied_owed.append((b.index, owed))

    monkeypatch.setattr(WeightPager, "_prefetch", checked)
    limit = 1e-3 if clip else None
    model = make_gpt(0, layers=4)
    off = run(tsd, False, device, model=model, max_grad_norm=limit, snapshot_at=4, param_offload=[0, 2])
    on = run(tsd, True, device, model=model, max_grad_norm=limit, snapshot_at=4, param_offload=[0, 2])
    assert_same(on, off)
    assert copied_owed == []
    assert any("paged from tsd's memory" in e for e in on["events"]), on["events"]
    n_paged = sum(1 for i in (0, 2) for _ in model.blocks[i].parameters())
    # Every bucket is deferred after a step from the second on, the paged blocks' among them.
    assert min(on["pending"][1:]) >= n_paged, on["pending"]
    assert max(on["pending"][1:]) == len(list(model.parameters())), on["pending"]  # every bucket (the head is tied)
    for (ma, oa), (mb, ob) in [(on["snap"], off["snap"])]:
        assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
        for i in oa:
            for k in ("exp_avg", "exp_avg_sq", "master", "step"):
                assert torch.equal(oa[i][k], ob[i][k]), (i, k)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_waits_for_its_updates(tsd, device):
    """torch.compile, before wrap() or after: the first step runs eagerly (the forward order is
    recorded), then each compiled forward calls the wait hooks (a graph break at each), also where
    this process compiled the same model class earlier without them (the first run here: dynamo
    does not guard on hooks); and with weight paging, whose hooks swap the blocks' storage (a
    traced `p.data = ...` failed to compile). Graphs broken at the hooks fuse differently from the unbroken one,
    so the comparison is to 1e-6, not bitwise; a forward that read weights before their update
    would be a whole step behind."""
    import torch._dynamo
    torch._dynamo.reset()
    try:
        off = run(tsd, False, device, steps=4, max_grad_norm=1e-3, compile="before")
        for when, paged in (("before", False), ("after", False), ("after", True)):
            kw = {"param_offload": True} if paged else {}
            on = run(tsd, True, device, steps=4, max_grad_norm=1e-3, compile=when, **kw)
            assert max(on["pending"][1:]) > 0 and any("finish during the next forward" in e for e in on["events"])
            assert not paged or any(e.startswith("param_offload=True: the weights of blocks") for e in on["events"])
            assert on["losses"] == pytest.approx(off["losses"], rel=1e-6, abs=1e-6), (when, paged)
            assert max((x - y).abs().max().item() for x, y in zip(on["params"], off["params"])) < 1e-6, (when, paged)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_unwrap_right_after_step_gives_the_updated_weights(tsd, device, clip):
    off = run(tsd, False, device, max_grad_norm=clip, unwrap_after=2)
    on = run(tsd, True, device, max_grad_norm=clip, unwrap_after=2)
    assert on["pending"][-1] > 0  # unwrap() found updates still owed
    assert_same(on, off)


def test_forward_order_reaches_tsd_and_pending_updates_wait_where_needed(tsd):
    """The recorded order starts with the token embedding (the tied head comes first through it);
    after step() the model's state dict, a module called on its own and optimizer.synchronize()
    each complete what they read."""
    model = make_gpt(0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, max_grad_norm=1e-3, overlap_forward=True)
    s = trainstream.unwrap_session(model)
    try:
        data = batches(3)
        for t in data[:2]:
            loss_of(model, t).backward()
            opt.step()
        bucket_of = {id(ps.param): ps.bucket for ps in s.params}
        assert s.forward_order[0] == bucket_of[id(model.tok.weight)]
        assert s.forward_order[1] == bucket_of[id(model.pos.weight)]
        assert len(s.forward_order) == len(s.params)  # every parameter is used inside a forward
        assert any("overlap_forward" in e for e in s.events)
        # A module called outside the model's forward completes its own buckets, not the others'.
        before = set(s.waits.pending)
        head_bucket = bucket_of[id(model.ln.weight)]
        assert head_bucket in before
        model.ln(torch.zeros(1, 32))
        assert head_bucket not in s.waits.pending
        assert bucket_of[id(model.tok.weight)] in s.waits.pending
        # The model's state dict completes everything first.
        model.state_dict()
        assert not s.waits.pending
        loss_of(model, data[2]).backward()
        opt.step()
        assert s.waits.pending
        opt.synchronize()
        assert not s.waits.pending
        assert opt.last_grad_norm > 0
    finally:
        trainstream.unwrap(model)


class ParentReads(nn.Module):
    """Reads its child's weight in its own forward before the child runs (a pre-hook on the child
    alone would come too late), and has a parameter of its own used only outside any forward."""

    def __init__(self):
        super().__init__()
        self.gpt = make_gpt(0)
        self.mix = nn.Linear(32, 32)
        self.outside = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, idx):
        h = self.gpt.tok(idx)
        h = h + F.linear(h, self.mix.weight)  # the parent uses mix.weight first
        h = self.mix(h)  # then mix runs itself
        for blk in self.gpt.blocks:
            h = blk(h)
        return self.gpt.head(self.gpt.ln(h))


def parent_loss(model, t):
    return loss_of(model, t) * model.outside.squeeze()  # `outside` is read outside every forward


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_parameters_read_by_another_module_or_outside_forward(tsd, device, act):
    """`act`: with activation paging (on CUDA, activation_offload="auto" installs its profiler by
    default), whose block pre-hooks look at every parameter: that look is not a use."""
    torch.manual_seed(3)
    base = ParentReads()
    off = run(tsd, False, device, model=base, loss_fn=parent_loss, activation_offload=act)
    on = run(tsd, True, device, model=base, loss_fn=parent_loss, activation_offload=act)
    assert_same(on, off)
    assert any("the others at step()" in e for e in on["events"]), on["events"]  # `outside`, gpt.pos not deferred


def test_changing_a_parameter_while_its_update_is_owed_is_refused(tsd):
    model = make_gpt(0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, overlap_forward=True)
    try:
        data = batches(3)
        loss_of(model, data[0]).backward()
        opt.step()
        with torch.no_grad():
            model.blocks[0].fc.weight.mul_(0.5)  # without synchronize(): the update would be lost
        changed = model.blocks[0].fc.weight.detach().clone()
        with pytest.raises(RuntimeError, match="synchronize"):
            loss_of(model, data[1])
        assert torch.equal(model.blocks[0].fc.weight, changed)  # the change is kept, the update dropped
        # After synchronize() a change is safe: the master follows it at the next gradient.
        loss_of(model, data[1]).backward()
        opt.step()
        opt.synchronize()
        with torch.no_grad():
            model.blocks[0].fc.weight.mul_(0.5)
        halved = model.blocks[0].fc.weight.detach().clone()
        model.blocks[0].fc(torch.zeros(1, 32))  # nothing owed any more: the forward keeps the change
        assert torch.equal(model.blocks[0].fc.weight, halved)
        loss_of(model, data[2]).backward()
        opt.step()
    finally:
        trainstream.unwrap(model)


def test_overlap_forward_option_is_checked(tsd):
    model = make_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    with pytest.raises(ValueError, match="overlap_forward must be True or False"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, overlap_forward="yes")
