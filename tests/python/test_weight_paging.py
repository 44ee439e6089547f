"""Weight paging (wrap(param_offload=...), trainstream.paging.weights): the weights of paged blocks
live in tsd's memory and visit the device only while forward or backward needs them.

The CPU tests run every path but the CUDA streams on device="cpu" with a real tsd; the CUDA tests
(skipped without a GPU) prove the streams, the memory saved, the capped auto plan and the
watchdog. Paging never changes results: paged runs are compared with unpaged tsd runs for exact
equality (losses and parameters), since both run the same AdamW in tsd."""
import copy
import gc
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream
from gpt import GPT, batches, loss_of, make_gpt, param_groups, train
from trainstream.paging import schedule
from trainstream.planner import Budget, MemoryPlanner
from trainstream.wiring import unwrap_session

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HP = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the GPU machine)")


# --------------------------------------------------------------------------- models and loops
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    """TrainStream's planner test model: an embedding, `n` MLP blocks, a head."""

    def __init__(self, d=256, n=6, vocab=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class CheckpointedGPT(GPT):
    """The test GPT with gradient checkpointing around every block."""

    def __init__(self, reentrant, **kw):
        super().__init__(**kw)
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=self.reentrant) if torch.is_grad_enabled() else blk(x)
        return self.head(self.ln(x))


def lm_steps(model, opt, data, between=None):
    out = []
    for k, t in enumerate(data):
        logits = model(t[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
        if between:
            between(k)
    return out


def tokens(n, seed=3, batch=8, seq=32, vocab=128, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device) for _ in range(n)]


def params_of(model):
    """name -> a CPU copy of every parameter (paged ones from tsd's memory, through state_dict())."""
    sd = model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def assert_same(a, b, what):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: parameters differ bit-wise: {bad[:5]} (max diff " \
                    f"{max((a[k] - b[k]).abs().max().item() for k in bad):.3g}); paging must not change results"


def storage_bytes(module):
    return sum(p.untyped_storage().nbytes() for p in module.parameters())


def wrapped_run(tsd, make, device, steps, data=None, opt_groups=None, between=None, after_wrap=None, **wrap_kw):
    """Trains make() wrapped with wrap_kw; returns (losses, parameters, events, the session)."""
    model = make()
    groups = opt_groups(model) if opt_groups else [p for p in model.parameters() if p.requires_grad]
    model, opt = trainstream.wrap(model, torch.optim.AdamW(groups, **HP), device=device, socket=tsd.socket,
                                  offload=True, **wrap_kw)
    s = unwrap_session(model)
    try:
        if after_wrap:
            after_wrap(model, s)
        data = data if data is not None else batches(steps, device=device)
        losses = []
        for k, t in enumerate(data[:steps]):
            loss = loss_of(model, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if between:
                between(k, model, s)
        return losses, params_of(model), list(s.events), s
    finally:
        trainstream.unwrap(model)


# --------------------------------------------------------------------------- CPU: results and paths
@pytest.mark.parametrize("offload,accumulation,clip", [(True, 1, None), (0.5, 2, 0.05), ([1, 3], 1, 1.0)])
def test_paged_run_equals_unpaged_bit_for_bit(tsd, offload, accumulation, clip):
    """Every block, half the blocks, two chosen blocks; with accumulation and clipping."""
    data = batches(8 * accumulation)

    def run(po):
        model = make_gpt(0, layers=4, d=32)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cpu",
                                      socket=tsd.socket, offload=True, param_offload=po, max_grad_norm=clip,
                                      accumulation_steps=accumulation)
        s = unwrap_session(model)
        try:
            losses = train(model, opt, data, 8, accumulation)
            paged = set(s.pager.paged) if s.pager else set()
            empty = [i for i, blk in enumerate(model.blocks) if storage_bytes(blk) == 0]
            return losses, params_of(model), paged, empty, s
        finally:
            trainstream.unwrap(model)

    a, pa, _, _, _ = run(False)
    b, pb, paged, empty, s = run(offload)
    want = {0, 1, 2, 3} if offload is True else {0, 2} if offload == 0.5 else set(offload)
    assert paged == want
    assert set(empty) == want, "paged blocks hold no weights between steps"
    assert b == a, "losses of the paged run differ from the unpaged run's"
    assert_same(pb, pa, f"param_offload={offload!r}")
    assert any("param_offload" in e and "paged from tsd's memory" in e for e in s.events)


def test_optimizer_state_dict_with_paged_blocks_equals_unpaged(tsd):
    """The optimizer's state_dict() has every paged parameter's state in its shape, equal to an
    unpaged run's; load_state_dict() of the unpaged run's state gives the paged run that state."""
    data = batches(3)

    def run(po):
        model = make_gpt(0, layers=3, d=32)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cpu",
                                      socket=tsd.socket, offload=True, param_offload=po)
        train(model, opt, data, 3)
        return model, opt

    ref, ref_opt = run(False)
    mine, opt = run([0, 2])
    try:
        a, b = ref_opt.state_dict(), opt.state_dict()
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            for part in ("exp_avg", "exp_avg_sq", "master"):
                assert b["state"][k][part].shape == a["state"][k][part].shape, (k, part)
                assert torch.equal(b["state"][k][part], a["state"][k][part]), (k, part)
        with torch.no_grad():
            for st in a["state"].values():
                st["exp_avg"].mul_(0.5)  # something to load: half the unpaged run's first moments
        want = {k: v["exp_avg"].clone() for k, v in a["state"].items()}
        opt.load_state_dict(a)
        c = opt.state_dict()
        for k in want:
            assert torch.equal(c["state"][k]["exp_avg"], want[k]), k
            assert torch.equal(c["state"][k]["master"], b["state"][k]["master"]), k  # the weights stay
    finally:
        trainstream.unwrap(mine)
        trainstream.unwrap(ref)


@pytest.mark.parametrize("how", ["state_dict", "stream"])
def test_save_and_restore_mid_run_with_paging_equals_an_unpaged_run(tsd, tmp_path, how):
    """The model's and the optimizer's state saved after 4 of 8 steps of a paged run (blocks 0
    and 2), the run going on, then restored: in place mid-run (model.load_state_dict() writes the
    paged blocks' slots) and into a fresh model wrapped with other blocks paged (every block);
    the optimizer's state by state_dict() / load_state_dict() or streamed (save_state /
    load_state). Both continuations equal the uninterrupted unpaged run bit for bit."""
    data = batches(8)

    def start(po, seed=0, state=None):
        model = make_gpt(seed, layers=4, d=32)
        if state is not None:
            model.load_state_dict(state)
        return trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cpu",
                                socket=tsd.socket, offload=True, param_offload=po, moment_dtype="float32")

    ref, ref_opt = start(False)
    try:
        want = train(ref, ref_opt, data, 8)
        want_params = params_of(ref)
    finally:
        trainstream.unwrap(ref)

    path = tmp_path / "opt.safetensors"
    mine, opt = start([0, 2])
    s = unwrap_session(mine)
    try:
        assert train(mine, opt, data[:4], 4) == want[:4]
        saved_model = {k: v.clone() for k, v in mine.state_dict().items()}
        if how == "stream":
            with open(path, "wb") as f:
                opt.save_state(f)
            saved_groups = copy.deepcopy(opt.state_dict()["param_groups"])
        else:
            saved_opt = opt.state_dict()  # views of a snapshot: the state at this call
        assert train(mine, opt, data[4:6], 2) == want[4:6]  # the run goes on
        # Back to step 4, in place, with blocks 0 and 2 still paged.
        mine.load_state_dict(saved_model)
        if how == "stream":
            with open(path, "rb") as f:
                opt.load_state(f)
            for g, saved in zip(opt.param_groups, saved_groups):
                g.update({k: v for k, v in saved.items() if k != "params"})
        else:
            opt.load_state_dict(saved_opt)
        assert s.pager.paged == {0, 2} and storage_bytes(mine.blocks[0]) == 0
        assert train(mine, opt, data[4:], 4) == want[4:], "the in-place restore changed the run"
        assert_same(params_of(mine), want_params, f"restored in place ({how})")
    finally:
        trainstream.unwrap(mine)

    fresh, opt2 = start(True, seed=7, state=saved_model)  # every block paged, from the saved weights
    try:
        if how == "stream":
            with open(path, "rb") as f:
                opt2.load_state(f)
        else:
            opt2.load_state_dict(saved_opt)
        assert unwrap_session(fresh).pager.paged == {0, 1, 2, 3}
        assert train(fresh, opt2, data[4:], 4) == want[4:], "the restore into a fresh paged run changed the run"
        assert_same(params_of(fresh), want_params, f"restored into a fresh wrap ({how})")
    finally:
        trainstream.unwrap(fresh)


def test_unwrap_gives_every_weight_back_and_the_model_trains_on(tsd):
    ref = make_gpt(0, layers=3)
    mine = copy.deepcopy(ref)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), device="cpu", socket=tsd.socket,
                                 offload=True, param_offload=True)
    s = unwrap_session(mine)
    assert s.pager.paged == {0, 1, 2} and s.pager.frozen_bytes == 0
    assert all(storage_bytes(b) == 0 for b in mine.blocks)
    assert all(p.shape == (0,) for p in mine.blocks[0].parameters())
    trainstream.unwrap(mine)
    assert s.pager is None
    for (n, p), (_, q) in zip(mine.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and torch.equal(p, q), n  # no step was taken: the initial weights
    assert not mine._forward_pre_hooks and not mine.blocks[0]._forward_pre_hooks  # hooks gone
    loss_of(mine, batches(1)[0]).backward()  # a plain model again
    assert all(p.grad is not None for p in mine.parameters())


def test_activation_paging_and_weight_paging_together(tsd):
    """The weight pager's saved-tensor hooks sit on top of the activation pager's and hand it
    every saved tensor that is not a weight."""
    make = lambda: make_gpt(0, layers=3, d=64)  # noqa: E731
    low = lambda m, s: setattr(s.act_pager, "min_bytes", 1024)  # noqa: E731  (this model's tensors are small)
    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 6)
    b, pb, _, s = wrapped_run(tsd, make, "cpu", 6, param_offload=[0, 2], activation_offload=True, after_wrap=low)
    assert s.act_pager is None  # unwrapped
    assert b == a
    assert_same(pb, pa, "activation + weight paging")


def test_activation_auto_finds_the_block_stack_of_paged_blocks(tsd):
    """activation_offload="auto" looks for the block stack after the weight pager paged it: a paged
    block's parameters are empty then, so counting parameters finds no stack. It must take the
    pager's (on the H200 a 1.5B under a 4 GiB cap paged no activation and ran out of memory)."""
    model = make_gpt(0, layers=3, d=64)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu",
                                  socket=tsd.socket, offload=True, param_offload=True, activation_offload="auto")
    try:
        events = unwrap_session(model).events
        assert not any("no repeated block stack" in e for e in events), events
        assert any("activation_offload=auto: the device is the CPU" in e for e in events), events
    finally:
        trainstream.unwrap(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(tsd, reentrant):
    """Blocks recomputed in backward: a paged block is brought back for the recompute and kept
    until its backward is done."""
    make = lambda: CheckpointedGPT(reentrant, layers=4, d=32)  # noqa: E731

    def seeded():
        torch.manual_seed(0)
        return make()

    a, pa, _, _ = wrapped_run(tsd, seeded, "cpu", 6)
    b, pb, _, s = wrapped_run(tsd, seeded, "cpu", 6, param_offload=[0, 1, 3])
    assert b == a
    assert_same(pb, pa, f"checkpointing (use_reentrant={reentrant})")
    assert s.pager is None


def test_frozen_base_is_paged_from_a_region_of_its_own(tsd):
    """A LoRA-like run: the blocks' linear weights are frozen (tsd's arena holds their paged
    copies), the norms and biases train (their parameter slots are their paged copies)."""

    def make():
        m = make_gpt(0, layers=4, d=32)
        for blk in m.blocks:
            for lin in (blk.qkv, blk.proj, blk.fc, blk.out):
                lin.weight.requires_grad_(False)
        return m

    seen = {}

    def look(model, s):
        seen["frozen"] = s.pager.frozen_bytes
        seen["trained"] = s.pager.trained_paged_bytes
        seen["arena"] = s.pager.arena.capacity_bytes if s.pager.arena else 0
        seen["job"] = [j for j in s.client.jobs() if j.name == s.client.job][0].used_bytes

    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 6)
    b, pb, _, _ = wrapped_run(tsd, make, "cpu", 6, param_offload=True, after_wrap=look)
    d = 32
    assert seen["frozen"] == 4 * 4 * (3 * d * d + d * d + 4 * d * d + 4 * d * d)  # 4 blocks, fp32
    assert seen["trained"] > 0 and seen["arena"] >= seen["frozen"]
    assert seen["job"] >= seen["arena"]  # the region is the job's, charged to its quota
    assert b == a
    assert_same(pb, pa, "frozen base paged")


def test_blocks_move_between_vram_and_ram_mid_training_without_changing_results(tsd):
    """TrainStream's test, on the CPU: page(i) / unpage(i) between steps; the result equals an
    unpaged run exactly (and torch.optim.AdamW closely)."""
    torch.manual_seed(0)
    ref = Stack(d=64)
    mine, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    data = tokens(8)
    a = lm_steps(ref, opt_ref, data)
    plain, opt_plain = trainstream.wrap(plain, torch.optim.AdamW(plain.parameters(), **HP), device="cpu",
                                        socket=tsd.socket, offload=True, activation_offload=False)
    try:
        c = lm_steps(plain, opt_plain, data)
        pc = params_of(plain)
    finally:
        trainstream.unwrap(plain)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), device="cpu", socket=tsd.socket,
                                 offload=True, param_offload=[0, 2, 4], activation_offload=False)
    pager = unwrap_session(mine).pager
    moves = {1: ([0], [1, 5]), 3: ([1, 2, 4, 5], []), 5: ([], [0, 3])}  # after step k: (unpage, page)

    def between(k):
        if k in moves:
            unpage, page = moves[k]
            for i in page:
                assert pager.page(i)
            for i in unpage:
                assert pager.unpage(i)

    try:
        b = lm_steps(mine, opt, data, between)
        opt.synchronize()
        assert b == pytest.approx(a, abs=1e-4)
        assert b == c  # exactly the unpaged tsd run
        assert pager.paged == {0, 3}
        assert not pager.page(0) and not pager.unpage(1)  # already there: nothing to do
        sizes = [storage_bytes(blk) for blk in mine.blocks]
        assert all(sizes[i] > 0 for i in (1, 2, 4, 5)) and sizes[0] == sizes[3] == 0
        pm = params_of(mine)
        assert_same(pm, pc, "blocks moved mid-training")
        sd_ref = ref.state_dict()
        assert max((pm[k] - sd_ref[k].float()).abs().max().item() for k in sd_ref) < 2e-4
    finally:
        trainstream.unwrap(mine)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_move_under_overlap_forward_completes_only_its_blocks_updates_and_changes_no_result(tsd, clip, device):
    """overlap_forward=True owes each step's updates to the next forward. Paging or unpaging one
    block between steps completes the updates of that block's buckets (a page copies the updated
    weights into its slots) and leaves the rest owed, so the next forward still overlaps them; the
    run equals an unpaged one with overlap exactly."""
    torch.manual_seed(0)
    ref = Stack(d=64)
    plain, mine = copy.deepcopy(ref).to(device), copy.deepcopy(ref).to(device)
    data = tokens(8, device=device)
    kw = dict(device=device, socket=tsd.socket, offload=True, activation_offload=False, overlap_forward=True,
              max_grad_norm=clip)
    plain, opt_plain = trainstream.wrap(plain, torch.optim.AdamW(plain.parameters(), **HP), **kw)
    try:
        c = lm_steps(plain, opt_plain, data)
        pc = params_of(plain)
    finally:
        trainstream.unwrap(plain)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), param_offload=[0, 2], **kw)
    s = unwrap_session(mine)
    pager = s.pager
    moves = {1: ([0], [1, 5]), 3: ([1, 2, 5], [3]), 5: ([], [0, 4])}  # after step k: (unpage, page)
    owed_after: list[int] = []

    def buckets_of(i):
        return {s.by_param[id(p)].bucket for p in mine.blocks[i].parameters()}

    def between(k):
        if k not in moves:
            return
        unpage, page = moves[k]
        for i in page + unpage:
            owed = set(s.waits.pending)
            assert owed, "overlap_forward owes the step's updates to the next forward"
            assert pager.page(i) if i in page else pager.unpage(i)
            left = set(s.waits.pending)
            assert not left & buckets_of(i), f"block {i}'s updates are completed before it moves"
            assert left == owed - buckets_of(i), "the other blocks' updates stay owed to the next forward"
            owed_after.append(len(left))

    try:
        b = lm_steps(mine, opt, data, between)
        opt.synchronize()
        assert b == c  # exactly the unpaged tsd run with overlap
        assert pager.paged == {0, 3, 4}
        assert_same(params_of(mine), pc, "blocks moved between steps under overlap_forward")
        assert min(owed_after) > 0
    finally:
        trainstream.unwrap(mine)


def test_eval_and_generation_with_paged_blocks(tsd):
    torch.manual_seed(0)
    ref = Stack(d=64)
    mine = copy.deepcopy(ref)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), device="cpu", socket=tsd.socket,
                                 offload=True, param_offload=[1, 2, 5])
    try:
        mine.eval()
        ref.eval()
        x = tokens(1)[0][:, :-1]
        with torch.no_grad():
            assert torch.equal(mine(x), ref(x))
        assert storage_bytes(mine.blocks[1]) == 0  # freed again after the forward

        def greedy(model, idx, n):
            for _ in range(n):
                nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], 1)
            return idx

        with torch.inference_mode():
            out = greedy(mine, x[:2, :4], 6)
        with torch.no_grad():
            assert torch.equal(out, greedy(ref, x[:2, :4], 6))
        mine.train()
        # Training after inference-mode forwards: the weights copied in are ordinary tensors.
        lm_steps(mine, opt, tokens(2))
    finally:
        trainstream.unwrap(mine)


def test_param_offload_options_are_checked(tsd):
    model = make_gpt(0, layers=2)
    opt = torch.optim.AdamW(model.parameters())
    for bad, match in ((0.0, "fraction"), (1.5, "fraction"), ("some", "must be False, True, 'auto'"),
                       ([0, "1"], "ints"), ([-1], "ints"), ([2], r"not in \[0, 2\)"), (3, "must be False")):
        with pytest.raises(ValueError, match=match):
            trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, param_offload=bad)
    with pytest.raises(ValueError, match=r"repeated block stack.*Sequential has none"):
        seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        trainstream.wrap(seq, torch.optim.AdamW(seq.parameters()), device="cpu", socket=tsd.socket, param_offload=True)
    with pytest.raises(ValueError, match="repeated block stack"):
        trainstream.plan_wrap(seq, torch.optim.AdamW(seq.parameters()), device="cpu", socket=tsd.socket,
                              param_offload=[0])
    assert trainstream.unwrap_session(model) is None  # nothing was wrapped
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    # "auto" (a candidate default) takes a model without a block stack: nothing to page, no pager.
    seq, seq_opt = trainstream.wrap(seq, torch.optim.AdamW(seq.parameters()), device="cpu", socket=tsd.socket,
                                    param_offload="auto")
    try:
        s = unwrap_session(seq)
        assert s.pager is None
        assert any("pages nothing (the model has no repeated block stack)" in e for e in s.events), s.events
    finally:
        trainstream.unwrap(seq)
    # On the CPU there is no VRAM to plan for: "auto" pages nothing, and says so.
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, param_offload="auto")
    s = unwrap_session(model)
    try:
        assert s.pager.paged == set() and s.planner is None
        assert any("pages nothing on cpu" in e for e in s.events)
        with pytest.raises(ValueError, match=r"block index must be an int in \[0, 2\)"):
            s.pager.page(2)
        with pytest.raises(ValueError, match="block index"):
            s.pager.unpage(True)
        s.pager.page(1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict({k: v + 1 for k, v in before.items()})  # into the paged block's slots too
        assert s.pager.paged == {1} and storage_bytes(model.blocks[1]) == 0
        after = model.state_dict()
        assert all(torch.equal(after[k], before[k] + 1) for k in before)
        s.pager.unpage(1)
        assert torch.equal(model.blocks[1].fc.weight, before["blocks.1.fc.weight"] + 1)
        model.load_state_dict(before)  # resident again: loads as usual
    finally:
        trainstream.unwrap(model)


def test_an_optimizer_that_already_stepped_keeps_its_state_with_paged_blocks(tsd):
    """wrap() loads the state of an optimizer that stepped before it, then pages: the paged run
    equals the unpaged one."""
    data = batches(6)

    def run(po):
        model = make_gpt(0, layers=4, d=32)
        opt = torch.optim.AdamW(model.parameters(), **HP)
        for t in data[:2]:  # two stock steps first
            loss_of(model, t).backward()
            opt.step()
            opt.zero_grad()
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, offload=True, param_offload=po)
        try:
            losses = lm_free_train(model, opt, data[2:])
            return losses, params_of(model)
        finally:
            trainstream.unwrap(model)

    a, pa = run(False)
    b, pb = run([0, 2, 3])
    assert b == a
    assert_same(pb, pa, "stepped optimizer, then paging")


def lm_free_train(model, opt, data):
    out = []
    for t in data:
        loss = loss_of(model, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_param_dtype_working_copies_are_paged_into_their_slots(tsd):
    """param_dtype=torch.bfloat16: a paged block's working copies are bf16 in its slots, cast from
    the fp32 weights the same way as resident ones."""
    make = lambda: make_gpt(0, layers=4, d=32)  # noqa: E731
    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 6, param_dtype=torch.bfloat16)
    b, pb, _, s = wrapped_run(tsd, make, "cpu", 6, param_dtype=torch.bfloat16, param_offload=[0, 3])
    assert b == a
    assert_same(pb, pa, "bf16 working copies paged")


def test_unwrap_counts_what_giving_the_model_back_needs_on_its_device(tsd):
    """What unwrap() weighs against the device's free memory before giving a model back there (on
    CUDA it gives it back on the CPU when that does not fit: a 1.5B model passed on the CPU ran out
    of memory under a 4 GiB cap in unwrap(), after training): the paged blocks' weights in their
    own dtype, and the own-dtype copy of every resident parameter param_dtype= cast."""
    from trainstream.wiring import _needed_to_give_back

    model = make_gpt(0, layers=4, d=32)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu",
                                  socket=tsd.socket, offload=True, param_offload=[0, 3],
                                  param_dtype=torch.bfloat16)
    s = unwrap_session(model)
    try:
        lm_free_train(model, opt, batches(1))
        paged = {id(p) for i in (0, 3) for p in model.blocks[i].parameters()}
        cast = {id(ps.param) for ps in s.params if ps.orig_dtype != ps.param.dtype}
        shapes = {id(w.param): w.shape for b in s.pager.blocks if b.paged for w in b.weights}
        assert set(shapes) == paged and paged <= cast  # paged blocks are empty now; their weights are cast ones
        expect = sum(math.prod(shape) * 4 for shape in shapes.values())  # fp32, brought back
        expect += sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values()
                      if id(p) in cast and id(p) not in paged)
        assert _needed_to_give_back(s, model) == expect
    finally:
        trainstream.unwrap(model)
    assert all(p.dtype == torch.float32 and p.numel() > 0 for p in model.parameters())
    assert _needed_to_give_back(s, model) == 0  # given back: the pager is closed, nothing is cast


@pytest.mark.parametrize("own", [torch.float32, torch.float16])
def test_unwrap_counts_the_gpu_shares_cast_parameters_only_when_their_master_is_not_their_dtype(tsd, own):
    """optimizer_gpu_fraction= with param_dtype=: a shared parameter goes back as its fp32 master
    cast to its own dtype. An fp32 model takes the master itself (nothing more); an fp16 one
    needs a new fp16 tensor per shared parameter."""
    from trainstream.wiring import _needed_to_give_back

    model = make_gpt(0, layers=2, d=32).to(own)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu",
                                  socket=tsd.socket, optimizer_gpu_fraction=0.5, param_dtype=torch.bfloat16)
    s = unwrap_session(model)
    try:
        assert s.share is not None and s.share.entries
        shared = [e for e in s.share.entries if not e.own and e.param.dtype != e.orig_dtype]
        assert shared
        cast = {id(ps.param) for ps in s.params if ps.orig_dtype != ps.param.dtype}
        expect = sum(p.numel() * own.itemsize for p in {id(p): p for p in model.parameters()}.values()
                     if id(p) in cast)
        if own != torch.float32:
            expect += sum(e.param.numel() * own.itemsize for e in shared)
        assert _needed_to_give_back(s, model) == expect
    finally:
        trainstream.unwrap(model)
    assert all(p.dtype == own for p in model.parameters())


def test_the_graph_keeps_no_weight_memory_between_forward_and_backward(tsd):
    """After forward, paged blocks hold no storage (but the last one, which backward needs first):
    the graph saved references to their weights, not the weights (an addmm saves weight.t(), a
    view that would keep the memory alive)."""
    model = make_gpt(0, layers=4, d=32)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu",
                                  socket=tsd.socket, offload=True, param_offload=[0, 1, 2])
    s = unwrap_session(model)
    try:
        loss = loss_of(model, batches(1)[0])
        assert [storage_bytes(b) > 0 for b in model.blocks] == [False, False, True, True]
        refs = s.pager.weight_refs
        assert refs >= 3 * 5  # qkv, proj, fc, out weights and the norms' parameters, per paged block
        loss.backward()
        assert [storage_bytes(b) > 0 for b in model.blocks] == [False, False, False, True]
        assert s.pager.moves == 3 + 2  # forward: 0, 1, 2; backward: 1, 0 (2 stayed)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(batches(1)[0][:, :-1])
        assert s.pager.weight_refs == refs  # nothing is saved without autograd
    finally:
        trainstream.unwrap(model)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_planner_drives_the_pager_from_measured_peaks(tsd, overlap):
    """The pager's step hook on the CPU, with the peak measurement replaced: a planner set on the
    session refines the plan (blocks move in and out between steps), settles after two steady
    steps, then its watchdog pages one block per grown step; results stay those of an unpaged
    run, and every decision is an event. With overlap_forward, each move completes only its own
    block's owed updates: after every step some updates are still owed to the next forward."""
    make = lambda: make_gpt(0, layers=6, d=32)  # noqa: E731
    data = batches(8)
    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 8, data=data, overlap_forward=overlap)
    steps = []

    def setup(model, s):
        s.planner = MemoryPlanner(Budget(vram_usable=2000), [100] * 6)  # target 1900

        def measure():  # 1350 besides the blocks (3000 more in step 6), 100 a block, two in flight
            steps.append(1)
            paged = s.pager.paged
            return (1350 + (3000 if len(steps) == 6 else 0) + 100 * (6 - len(paged))
                    + s.planner.buffers(paged))
        s.pager.measure = measure
        s.pager.reset_measure = lambda: None

    plans = []

    owed = []

    def between(k, model, s):
        plans.append((sorted(s.pager.paged), s.planner.done))
        owed.append(len(s.waits.pending))

    b, pb, events, s = wrapped_run(tsd, make, "cpu", 8, data=data, param_offload=[0, 1, 2, 3, 4],
                                   after_wrap=setup, between=between, overlap_forward=overlap)
    # 1650 with 5 paged: two more resident fit under the target (1900), a third would not (1950);
    # 1850 with 3 paged: steady, twice: settled; step 6 grows: the watchdog pages one block.
    assert [len(p) for p, _ in plans] == [3, 3, 3, 3, 3, 4, 4, 4], plans
    assert [d for _, d in plans] == [False, False, True, True, True, True, True, True], plans
    assert any(e.startswith("memory plan refined: 3 of 6 blocks resident") for e in events), events
    assert any(e.startswith("memory plan settled: 3 of 6 blocks resident") for e in events), events
    assert any(e.startswith("memory watchdog: step 6 peaked") for e in events), events
    assert b == a
    assert_same(pb, pa, "planner-driven moves")
    assert all(owed) if overlap else not any(owed), owed


def test_frozen_weights_that_tsd_cannot_hold_are_refused_and_nothing_stays(tsd):
    """The arena for frozen weights cannot grow past the job's quota: wrap() raises QuotaExceeded
    (naming the frozen weights and what to do), gives the paged blocks back and releases the job."""
    model = make_gpt(0, layers=4, d=128)
    for blk in model.blocks:
        for lin in (blk.qkv, blk.proj, blk.fc, blk.out):
            lin.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    need = trainstream.plan_wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                                 moment_dtype="float32").state_bytes
    # check_memory counts the paged frozen weights and refuses before anything is allocated ...
    with pytest.raises(trainstream.MemoryCheckFailed, match=r"paged frozen weights"):
        trainstream.wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                         moment_dtype="float32", quota=need + (64 << 10), param_offload=True)
    # ... and without it, the pager's arena is refused by the quota while paging.
    with pytest.raises(trainstream.QuotaExceeded, match=r"paged frozen weights.*page fewer blocks"):
        trainstream.wrap(model, torch.optim.AdamW(trainable), device="cpu", socket=tsd.socket,
                         moment_dtype="float32", quota=need + (64 << 10), param_offload=True, check_memory=False)
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0
    assert unwrap_session(model) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not model.blocks[0]._forward_pre_hooks


# --------------------------------------------------------------------------- prefetch depth, PCIe bytes, "auto"
def step_trace(model, opt, s, t):
    """One step; the pager's ("fetch"/"drop", block) events of its forward and backward."""
    s.pager.trace = []
    loss = loss_of(model, t)
    loss.backward()
    trace = list(s.pager.trace)
    opt.step()
    opt.zero_grad()
    s.pager.trace = None
    return loss.item(), trace


@pytest.mark.parametrize("depth,checkpointing", [(1, False), (2, False), (3, False), (2, True)])
def test_prefetch_depth_follows_the_schedule_and_changes_no_result(tsd, depth, checkpointing):
    """prefetch_depth=1, 2, 3 (and 2 with gradient checkpointing): the pager fetches and drops
    exactly what paging.schedule.simulate() says (depth paged blocks ahead, forward and backward
    order; a checkpointed block kept from its recompute to its backward), never more than
    depth + 1 blocks at once, and the results are bit-identical to an unpaged run's."""
    paged = [0, 2, 3, 5]
    make = (lambda: (torch.manual_seed(0), CheckpointedGPT(False, layers=6, d=32))[1]) if checkpointing else \
        (lambda: make_gpt(0, layers=6, d=32))  # noqa: E731
    data = batches(3)
    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 3, data=data)
    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket,
                                  offload=True, param_offload=paged, prefetch_depth=depth)
    s = unwrap_session(model)
    try:
        assert s.pager.depth == depth
        want = [e for e in schedule.simulate(6, paged, depth, recompute=checkpointing) if e[0] in ("fetch", "drop")]
        losses = []
        for t in data:
            loss, trace = step_trace(model, opt, s, t)
            losses.append(loss)
            assert trace == want, f"depth {depth}: the pager's trace {trace} is not the schedule's {want}"
            assert schedule.most_in_flight(trace) == depth + 1
        pb = params_of(model)
    finally:
        trainstream.unwrap(model)
    assert losses == a
    assert_same(pb, pa, f"prefetch_depth={depth}")


def test_prefetch_depth_option_is_checked_and_chosen(tsd):
    model = make_gpt(0, layers=4, d=32)
    for bad in (0, 2.5, "deep", True):
        with pytest.raises(ValueError, match="prefetch_depth"):
            trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                             param_offload=True, prefetch_depth=bad)
        assert unwrap_session(model) is None
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  offload=True, param_offload=[1, 2])
    try:
        s = unwrap_session(model)
        assert s.pager.depth == 1  # None on a CPU device: no VRAM to choose from
        assert any("prefetch depth 1" in e and "H2D per step" in e for e in s.events), s.events
    finally:
        trainstream.unwrap(model)


def test_h2d_bytes_planned_and_measured_per_step(tsd):
    """With accumulation a paged block crosses twice per micro-batch (the last paged one once: it
    stays from its forward to its backward): the pager's planned bytes per step equal what it
    measured copying, step after step."""
    model = make_gpt(0, layers=4, d=32)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket,
                                  offload=True, param_offload=[0, 2, 3], accumulation_steps=3)
    s = unwrap_session(model)
    try:
        pager = s.pager
        sizes = pager.block_bytes
        assert pager.micro_batches == 3
        assert pager.h2d_bytes_per_step == 3 * (2 * sizes[0] + 2 * sizes[2] + sizes[3])
        assert pager.last_step_h2d_bytes is None
        data = batches(6)
        train(model, opt, data, 2, 3)
        assert pager.last_step_h2d_bytes == pager.h2d_bytes_per_step
        assert pager.h2d_bytes == 2 * pager.h2d_bytes_per_step
        pager.unpage(0)
        assert pager.h2d_bytes_per_step == 3 * (2 * sizes[2] + sizes[3])
        with torch.no_grad():  # an inference forward: one crossing per paged block, none kept
            model(data[0][:, :-1])
        assert pager.h2d_bytes == 2 * 3 * (2 * sizes[0] + 2 * sizes[2] + sizes[3]) + sizes[2] + sizes[3]
    finally:
        trainstream.unwrap(model)


def test_auto_on_a_model_that_fits_pages_nothing_installs_no_hook_and_changes_nothing(tsd):
    """param_offload="auto" where everything fits (here: a CPU device, nothing to plan for) pages
    no block and installs no hook at all: the run is the param_offload=False run, bit for bit.
    Paging a block later installs the hooks; unpaging the last one removes them again."""
    make = lambda: make_gpt(0, layers=4, d=32)  # noqa: E731
    data = batches(4)
    a, pa, _, _ = wrapped_run(tsd, make, "cpu", 4, data=data, param_offload=False)
    hooks = []

    def check(k, model, s):
        hooks.append((len(s.pager.paged), s.pager.hooks_installed, len(model._forward_pre_hooks),
                      sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks)))

    b, pb, events, s = wrapped_run(tsd, make, "cpu", 4, data=data, param_offload="auto", between=check)
    assert hooks == [(0, False, 0, 0)] * 4
    assert b == a
    assert_same(pb, pa, "param_offload='auto' on a model that fits")
    assert any("pages nothing" in e for e in events), events

    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", socket=tsd.socket,
                                  offload=True, param_offload="auto")
    try:
        pager = unwrap_session(model).pager
        assert not pager.hooks_installed
        pager.page(1)
        assert pager.hooks_installed and model.blocks[1]._forward_pre_hooks
        train(model, opt, data, 1)
        pager.unpage(1)
        assert not pager.hooks_installed and not model.blocks[1]._forward_pre_hooks
        train(model, opt, data[1:], 1)
    finally:
        trainstream.unwrap(model)


ROOMY = Budget(vram_usable=1 << 40)  # a budget in which stock AdamW fits: offload="auto" may switch on the CPU


def auto_run(tsd, make, data, between=None, after_wrap=None, offload="auto", **wrap_kw):
    """Trains make() with offload="auto" (and the given options); returns (losses, parameters,
    events, session, the optimizer's offloading after each step)."""
    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cpu",
                                  socket=tsd.socket, offload=offload, budget=ROOMY, **wrap_kw)
    s = unwrap_session(model)
    try:
        if after_wrap:
            after_wrap(model, s)
        losses, offloading = [], []
        for k, t in enumerate(data):
            loss = loss_of(model, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            offloading.append(opt.offloading)
            if between:
                between(k, model, s)
        return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}, list(s.events), s, \
            offloading
    finally:
        if unwrap_session(model) is not None:
            trainstream.unwrap(model)


def test_auto_is_the_default_and_offload_auto_switches_as_without_paging(tsd):
    """param_offload="auto" is wrap()'s default. On a model that fits (here the CPU, nothing to
    page) its pager pages nothing; offload="auto" then switches to stock AdamW after the second
    step exactly as with param_offload=False, and the switch releases the pager (no hook, every
    parameter a plain tensor with its storage). Losses and parameters equal the
    param_offload=False run's bit for bit, before and after the switch."""
    assert trainstream.wiring.OPTIONS["param_offload"] == "auto"
    make = lambda: make_gpt(0, layers=4, d=32)  # noqa: E731
    data = batches(5)
    a, pa, ea, sa, offa = auto_run(tsd, make, data, param_offload=False)
    seen = []

    def look(k, model, s):
        seen.append((s.pager is not None and s.pager.auto, len(model._forward_pre_hooks),
                     sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks),
                     all(p.untyped_storage().nbytes() > 0 for p in model.parameters())))

    b, pb, eb, sb, offb = auto_run(tsd, make, data, between=look)  # the default
    assert offa == offb == [True, False, False, False, False]
    assert seen == [(True, 0, 0, True)] + [(False, 0, 0, True)] * 4, seen
    assert sb.pager is None and sb.planner is None
    assert b == a
    assert_same(pb, pa, "param_offload='auto' (the default) with the switch to stock AdamW")
    switch = [e for e in eb if "switched to stock" in e]
    assert len(switch) == 1 and "the weight pager (nothing paged) was released" in switch[0], eb
    assert [e for e in ea if "switched to stock" in e] == [switch[0].split("; the weight pager")[0]]


@pytest.mark.parametrize("settles_paged", [False, True])
def test_offload_auto_waits_for_the_block_plan_and_follows_it(tsd, settles_paged):
    """With param_offload="auto" and a planner (set by hand on the CPU, its peaks replaced),
    offload="auto" decides once the plan settled, not at the second step: settled with nothing
    paged (the first step paged three blocks, the second moved them all back, two steady steps
    followed), the decision is made then, as without a pager, and the switch releases the pager;
    settled with blocks paged, offloading stays (their slots are their only copy). Until the
    switch the losses equal an offloaded unpaged run's bit for bit."""
    make = lambda: make_gpt(0, layers=6, d=32)  # noqa: E731
    data = batches(6)
    ref, _, _, _, _ = auto_run(tsd, make, data, offload=True, param_offload=False)
    steps = []

    def setup(model, s):
        s.planner = MemoryPlanner(Budget(vram_usable=2000), [100] * 6)  # target 1900

        def measure():  # 600 more besides the blocks in the first step; from the second on, 800 unless it settles paged
            steps.append(1)
            paged = s.pager.paged
            base = 1400 if len(steps) == 1 or settles_paged else 800
            return base + 100 * (6 - len(paged)) + s.planner.buffers(paged)
        s.pager.measure = measure
        s.pager.reset_measure = lambda: None

    plans = []

    def between(k, model, s):
        plans.append(sorted(s.pager.paged) if s.pager is not None else None)

    b, _, events, s, offloading = auto_run(tsd, make, data, after_wrap=setup, between=between)
    assert any("offload=auto: decides once the memory plan settled" in e for e in events), events
    if settles_paged:
        # step 1: 2000 > 1900, three blocks paged (1900); steady twice: settled at step 3, kept.
        assert plans == [[0, 2, 4]] * 6, plans
        assert offloading == [True] * 6
        assert s.offload is True
        assert any("keeps offloading (the weights of 3 of 6 blocks are paged" in e for e in events), events
        assert b == ref
    else:
        # step 1 pages three, step 2 (1300) moves them back, steps 3 and 4 are steady: settled, switched.
        assert plans == [[0, 2, 4], [], [], None, None, None], plans
        assert offloading == [True, True, True, False, False, False]
        assert any("switched to stock" in e and "weight pager (nothing paged) was released" in e for e in events)
        assert b[:4] == ref[:4]
        assert all(math.isfinite(x) for x in b)


# --------------------------------------------------------------------------- quantized frozen blocks
def make_qlora(layers=4, d=64, kind="nf4", device="cpu"):
    """The test GPT with its block linears quantized (trainstream.quant) and LoRA adapters (peft)
    on qkv and fc: only the adapters train."""
    peft = pytest.importorskip("peft")
    from trainstream import quant as Q
    m = make_gpt(0, layers=layers, d=d).to(device)
    Q.quantize_model(m, kind)
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "fc"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:  # B starts at zero: make the adapters matter from step one
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return m


def quantized_layers(model):
    from trainstream import quant as Q
    return [(n, Q.quantized_of(p)) for n, p in model.named_parameters() if Q.quantized_of(p) is not None]


def test_quantized_frozen_blocks_are_paged_and_change_no_result(tsd):
    """An NF4 base with LoRA adapters: the paged blocks' codes and absmax live in tsd's memory
    (the pager's region), visit the device only while used (nothing between steps, nothing kept
    by the graph), state_dict() reads them from tsd's memory without copying, and the run equals
    the unpaged one bit for bit; unpage() and unwrap() give the blocks back as ordinary quantized
    weights with the same codes."""
    from trainstream.paging.quantized import PagedQuantizedWeight
    data = batches(4)
    a, pa, _, _ = wrapped_run(tsd, make_qlora, "cpu", 4, data=data)
    model = make_qlora()
    before = {n: (q.codes.clone(), q.absmax.clone()) for n, q in quantized_layers(model)}
    model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HP),
                                  device="cpu", socket=tsd.socket, offload=True, param_offload=[0, 2, 3],
                                  prefetch_depth=2)
    s = unwrap_session(model)
    try:
        pager = s.pager
        assert [len(b.quants) for b in pager.blocks] == [4, 4, 4, 4]  # qkv, proj, fc, out of each block
        paged_q = {n: q for n, q in quantized_layers(model) if isinstance(q, PagedQuantizedWeight)}
        assert len(paged_q) == 12 and all(".blocks.1." not in n for n in paged_q)
        assert pager.quantized_paged_bytes == sum(q.nbytes for q in paged_q.values()) > 0
        assert pager.frozen_bytes > pager.quantized_paged_bytes  # the frozen norms and biases too
        assert all(q.dev_codes is None and q.lease is not None for q in paged_q.values())
        losses = []
        for k, t in enumerate(data):
            loss = loss_of(model, t)
            if k == 0:  # after forward: only the last paged block stays (backward needs it first)
                assert [q.dev_codes is not None for n, q in sorted(paged_q.items()) if n.endswith("qkv.base_layer.weight")] \
                    == [False, False, True]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            assert all(q.dev_codes is None for q in paged_q.values()), "a paged block's codes stayed on the device"
        assert pager.last_step_h2d_bytes == pager.h2d_bytes_per_step
        moved = pager.h2d_bytes
        sd = model.state_dict()
        assert pager.h2d_bytes == moved, "state_dict() copied paged blocks to the device"
        pb = {k: v.detach().float().cpu().clone() for k, v in sd.items()}
        del sd  # its paged entries are views of tsd's memory: unwrap() frees that region
        for n, q in paged_q.items():
            assert torch.equal(q.host_codes, before[n][0]) and torch.equal(q.host_absmax, before[n][1]), n
        with pytest.raises(RuntimeError, match="is paged"):
            next(iter(paged_q.values())).to(dtype=torch.float16)
        pager.unpage(2)
        back = dict(quantized_layers(model))
        assert not any(isinstance(q, PagedQuantizedWeight) for n, q in back.items() if ".blocks.2." in n)
        assert all(torch.equal(back[n].codes, before[n][0]) for n in back if ".blocks.2." in n)
    finally:
        trainstream.unwrap(model)
    assert losses == a, "paging the quantized base changed the losses"
    assert_same(pb, pa, "NF4 base paged")
    after = dict(quantized_layers(model))
    assert not any(isinstance(q, PagedQuantizedWeight) for q in after.values())
    for n, (codes, absmax) in before.items():
        assert torch.equal(after[n].codes, codes) and torch.equal(after[n].absmax, absmax), n


# --------------------------------------------------------------------------- CUDA
def cuda_pair_runs(tsd, make, steps, po, data=None, autocast=False, **kw):
    """(losses, params, session events) of an unpaged and a paged tsd run on CUDA."""
    def run(option):
        # The other run's model and session may still be alive in a reference cycle: collect them so
        # that their memory is not in this run's peak (on the H200 that was 53 MiB, and the paged
        # run, which comes second, looked as if paging raised the peak).
        gc.collect()
        torch.cuda.synchronize()
        model = make()
        model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                               **HP),
                                      device="cuda", socket=tsd.socket, offload=True, param_offload=option, **kw)
        s = unwrap_session(model)
        try:
            out = []
            torch.cuda.reset_peak_memory_stats()
            for t in (data or batches(steps, device="cuda")):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = loss_of(model, t)
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
            peak = torch.cuda.max_memory_allocated()
            return out, params_of(model), list(s.events), peak, (s.pager.moves if s.pager else 0)
        finally:
            trainstream.unwrap(model)
    return run(False), run(po)


@needs_cuda
@pytest.mark.parametrize("dtype,autocast", [(None, False), (torch.bfloat16, True)])
def test_cuda_paged_equals_unpaged_and_lowers_the_peak(tsd, dtype, autocast):
    """fp32 working weights, and bf16 working weights (param_dtype=) under bf16 autocast: paged vs
    unpaged identical bit for bit; the peak drops by most of the paged blocks' weights."""
    make = lambda: make_gpt(0, layers=8, d=256, seq=64)  # noqa: E731  8 blocks of 3 MiB (fp32)
    data = batches(6, batch=8, seq=64, device="cuda")
    (a, pa, _, peak_a, _), (b, pb, ev, peak_b, moves) = cuda_pair_runs(  # depth 1: two blocks in flight
        tsd, make, 6, True, data=data, autocast=autocast, param_dtype=dtype, prefetch_depth=1)
    print(f"param_dtype={dtype}: peak unpaged {peak_a / 2**20:.1f} MiB, every block paged {peak_b / 2**20:.1f} MiB, "
          f"{moves} block copies; events: {ev}")
    assert b == a, f"losses differ: unpaged {a} vs paged {b}"
    assert_same(pb, pa, f"CUDA param_dtype={dtype}")
    block = 12 * 256 * 256 * (2 if dtype else 4)
    assert peak_b < peak_a - 4 * block, (f"paging 8 blocks of {block / 2**20:.1f} MiB should lower the peak by more "
                                         f"than 4 of them: {peak_a / 2**20:.1f} -> {peak_b / 2**20:.1f} MiB")
    assert moves >= 6 * 8, "each block is copied in at least once per step"


@needs_cuda
def test_cuda_frozen_lora_base_paged(tsd):
    def make():
        m = make_gpt(0, layers=6, d=128)
        for blk in m.blocks:
            for lin in (blk.qkv, blk.proj, blk.fc, blk.out):
                lin.weight.requires_grad_(False)
        return m
    (a, pa, _, _, _), (b, pb, ev, _, _) = cuda_pair_runs(tsd, make, 6, [0, 2, 3, 5])
    assert b == a, f"losses differ: unpaged {a} vs paged {b}"
    assert_same(pb, pa, "CUDA frozen base paged")
    assert any("frozen (a region of their own)" in e and "0 B frozen" not in e for e in ev), ev


@needs_cuda
@pytest.mark.parametrize("reentrant", [False, True])
def test_cuda_gradient_checkpointing(tsd, reentrant):
    make = lambda: (torch.manual_seed(0), CheckpointedGPT(reentrant, layers=6, d=128))[1].cuda()  # noqa: E731
    (a, pa, _, _, _), (b, pb, _, _, _) = cuda_pair_runs(tsd, make, 6, 0.5)
    assert b == a, f"use_reentrant={reentrant}: losses differ: unpaged {a} vs paged {b}"
    assert_same(pb, pa, f"CUDA checkpointing use_reentrant={reentrant}")


@needs_cuda
def test_cuda_blocks_move_between_vram_and_ram_mid_training_without_changing_results(tsd):
    """TrainStream's test: after steps 1, 3 and 5 blocks are paged and unpaged."""
    torch.manual_seed(0)
    ref = Stack().cuda()
    mine, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    data = tokens(8, device="cuda")
    a = lm_steps(ref, opt_ref, data)
    plain, opt_plain = trainstream.wrap(plain, torch.optim.AdamW(plain.parameters(), **HP), socket=tsd.socket,
                                        offload=True, activation_offload=False)
    try:
        c = lm_steps(plain, opt_plain, data)
        pc = params_of(plain)
    finally:
        trainstream.unwrap(plain)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), socket=tsd.socket, offload=True,
                                 param_offload=[0, 2, 4], activation_offload=False)
    pager = unwrap_session(mine).pager
    moves = {1: ([0], [1, 5]), 3: ([1, 2, 4, 5], []), 5: ([], [0, 3])}

    def between(k):
        if k in moves:
            unpage, page = moves[k]
            for i in page:
                pager.page(i)
            for i in unpage:
                pager.unpage(i)

    try:
        b = lm_steps(mine, opt, data, between)
        opt.synchronize()
        assert b == pytest.approx(a, abs=1e-4)
        assert b == c, f"losses differ from the unpaged tsd run: {c} vs {b}"
        assert pager.paged == {0, 3}
        sizes = [storage_bytes(blk) for blk in mine.blocks]
        assert all(sizes[i] > 0 for i in (1, 2, 4, 5)) and sizes[3] == 0  # resident blocks hold weights
        assert all(p.is_cuda for p in mine.blocks[3].parameters())
        pm = params_of(mine)
        assert_same(pm, pc, "CUDA blocks moved mid-training")
        sd_ref = ref.state_dict()
        assert max((pm[k] - sd_ref[k].float().cpu()).abs().max().item() for k in sd_ref) < 2e-4
    finally:
        trainstream.unwrap(mine)


@needs_cuda
def test_cuda_eval_and_generation(tsd):
    torch.manual_seed(0)
    ref = Stack().cuda()
    mine = copy.deepcopy(ref)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), socket=tsd.socket, offload=True,
                                 param_offload=[0, 3, 4])
    try:
        lm_steps(mine, opt, tokens(2, device="cuda"))
        opt.synchronize()
        for name, p in ref.named_parameters():  # the reference takes the trained weights
            p.data.copy_(mine.state_dict()[name].to("cuda"))
        mine.eval()
        ref.eval()
        x = tokens(1, device="cuda")[0][:, :-1]
        with torch.no_grad():
            assert torch.equal(mine(x), ref(x))
        idx = x[:2, :4]
        with torch.inference_mode():
            for _ in range(6):
                idx = torch.cat([idx, mine(idx)[:, -1].argmax(-1, keepdim=True)], 1)
        with torch.no_grad():
            want = x[:2, :4]
            for _ in range(6):
                want = torch.cat([want, ref(want)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(idx, want)
        assert storage_bytes(mine.blocks[3]) == 0
    finally:
        trainstream.unwrap(mine)


@needs_cuda
def test_cuda_a_model_on_the_cpu_is_accepted_and_never_moved_whole(tsd):
    """A model passed on the CPU: resident blocks go to the GPU, paged ones straight into tsd's
    memory; the GPU never holds the whole model."""
    torch.manual_seed(0)
    model = Stack(d=512, n=8)  # 8 blocks of 8 MiB
    ref = copy.deepcopy(model)
    whole = sum(p.numel() * 4 for p in model.parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cuda",
                                  socket=tsd.socket, offload=True, param_offload=[0, 1, 2, 3, 4, 5])
    try:
        wrap_peak = torch.cuda.max_memory_allocated() - base
        assert wrap_peak < whole / 2, f"wrap() put {wrap_peak / 2**20:.1f} MiB on the GPU (whole model " \
                                      f"{whole / 2**20:.1f} MiB): paged blocks must go straight to tsd"
        assert all(p.is_cuda for p in model.blocks[7].parameters()) and storage_bytes(model.blocks[7]) > 0
        assert storage_bytes(model.blocks[0]) == 0 and model.emb.weight.is_cuda
        ref = ref.cuda()
        opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
        data = tokens(3, device="cuda")
        assert lm_steps(model, opt, data) == pytest.approx(lm_steps(ref, opt_ref, data), abs=1e-4)
    finally:
        trainstream.unwrap(model)


CAP_SCRIPT = textwrap.dedent(r"""
    import json, sys, torch
    sys.path[:0] = [@ROOT@, @HERE@]
    import trainstream
    from trainstream.blockplan import MARGIN
    from trainstream.planner import VRAM_HEADROOM
    from test_weight_paging import Stack, tokens, lm_steps, HP, CAP_DATA
    n, block, socket = @NBLOCKS@, 8 << 20, @SOCKET@  # blocks of 8 MiB (fp32)
    data = tokens(14, device="cuda", **CAP_DATA)
    # The reference: uncapped, unpaged, every block resident. Its peak sets the cap.
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    ref = Stack(d=512, n=n)
    ref, opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), **HP), device="cuda", offload=True,
                                param_offload=False, socket=socket)
    ref_losses = lm_steps(ref, opt, data)
    trainstream.unwrap(ref)
    peak = torch.cuda.max_memory_allocated() - base
    del ref, opt
    torch.cuda.empty_cache()
    # The plan's target (95% of 90% of the cap) lies 1.5 blocks under that peak.
    cap = int((peak - 1.5 * block) / (VRAM_HEADROOM * (1 - MARGIN)))
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory, 0)
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = Stack(d=512, n=n)  # on the CPU
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cuda", offload=True,
                                  param_offload="auto", socket=socket)
    s = trainstream.unwrap_session(model)
    first = sorted(s.pager.paged)
    plans = []
    def between(k):
        plans.append(sorted(s.pager.paged))
    losses = lm_steps(model, opt, data, between)
    opt.synchronize()
    print("@@" + json.dumps(dict(first=first, final=sorted(s.pager.paged), settled=s.planner.done, losses=losses,
                                 ref_losses=ref_losses, events=s.events, plans=plans, moments=opt.moment_dtype,
                                 cap=cap, peak=peak, reserved=torch.cuda.max_memory_reserved())))
    trainstream.unwrap(model)
""")
CAP_DATA = dict(batch=2, seq=16)  # few activations: the weights are what does not fit


@needs_cuda
def test_cuda_auto_plan_under_a_vram_cap_finds_the_split_and_trains_correctly(tsd):
    """TrainStream's capped subprocess: param_offload="auto" under a VRAM cap starts with blocks
    paged from the budget, refines the split from the measured peaks (moving some blocks into
    VRAM), settles, and its losses equal an uncapped, unpaged tsd run exactly.

    The subprocess first runs the uncapped, unpaged reference (16 blocks of 8 MiB, all resident)
    and sets the cap from its measured peak, so that the plan's target lies 1.5 blocks below it:
    the whole model cannot stay resident, and the budget-only first plan (which keeps a quarter of
    the VRAM for activations it has not seen) pages more blocks than the measured peaks show are
    needed."""
    import trainstream as ts
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ts.__file__)))  # the package these tests import
    code = (CAP_SCRIPT.replace("@ROOT@", repr(pkg)).replace("@HERE@", repr(HERE))
            .replace("@NBLOCKS@", "16").replace("@SOCKET@", repr(tsd.socket)))
    assert not any(f"@{k}@" in code for k in ("ROOT", "HERE", "NBLOCKS", "SOCKET"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads([line for line in out.stdout.splitlines() if line.startswith("@@")][-1][2:])
    print(json.dumps({k: v for k, v in res.items() if "losses" not in k}, indent=1))
    why = (f"uncapped peak {res['peak'] / 2**20:.1f} MiB, cap {res['cap'] / 2**20:.1f} MiB; events: {res['events']}; "
           f"plans after each step: {res['plans']}")
    assert res["first"], f"the cap must start with some blocks paged; {why}"
    assert res["settled"], why
    assert res["final"] != res["first"], f"measured peaks must change the plan; {why}"
    assert 0 < len(res["final"]) < len(res["first"]), f"headroom moves some blocks into VRAM, not all; {why}"
    assert any("memory plan settled" in e for e in res["events"]), why
    assert res["losses"] == res["ref_losses"], \
        f"the capped, re-planned run must equal the uncapped unpaged run exactly: {res['losses']} vs {res['ref_losses']}"


@needs_cuda
def test_cuda_watchdog_pages_a_block_when_a_later_step_grows(tsd):
    """A settled plan: a step like the others changes nothing; a step with a much larger batch
    peaks over the target and the watchdog pages one more block."""
    from trainstream.blockplan import MARGIN
    torch.manual_seed(0)
    model = Stack().cuda()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), socket=tsd.socket,
                                  offload=True, param_offload=[0], activation_offload=False)
    s = unwrap_session(model)
    used = torch.cuda.memory_allocated()
    usable = int((used + (64 << 20)) / (1 - MARGIN))  # the target is 64 MiB above what is allocated now
    s.planner = MemoryPlanner(Budget(vram_total=usable, vram_usable=usable, ram_total=1 << 36, ram_available=1 << 35),
                              s.pager.block_bytes, fixed_vram=0, inflight_bytes=1 << 20)
    s.planner.done = True  # settled; now a step with a much larger batch arrives
    try:
        before = len(s.pager.paged)
        torch.cuda.reset_peak_memory_stats()
        lm_steps(model, opt, tokens(1, device="cuda"))  # batch 8 x 32: well under the target
        assert len(s.pager.paged) == before, (s.events, torch.cuda.max_memory_allocated() - used)
        lm_steps(model, opt, tokens(1, batch=64, seq=128, device="cuda"))
        assert len(s.pager.paged) == before + 1, s.events
        assert any("memory watchdog" in e for e in s.events), s.events
    finally:
        trainstream.unwrap(model)


@needs_cuda
@pytest.mark.parametrize("depth,reentrant", [(1, None), (2, None), (3, None), (2, False), (3, True)])
def test_cuda_prefetch_depth_is_bit_identical_and_bounded(tsd, depth, reentrant):
    """prefetch_depth=1, 2, 3 on the copy stream (and with gradient checkpointing): losses and
    parameters equal the unpaged run's bit for bit; at most depth + 1 paged blocks are on the
    device at once, and the measured H2D bytes of a step are the planned ones."""
    if reentrant is None:
        make = lambda: make_gpt(0, layers=8, d=128)  # noqa: E731
    else:
        make = lambda: (torch.manual_seed(0), CheckpointedGPT(reentrant, layers=8, d=128))[1]  # noqa: E731
    data = batches(5, batch=8, device="cuda")
    (a, pa, _, _, _), _ = cuda_pair_runs(tsd, make, 5, False, data=data)
    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cuda",
                                  socket=tsd.socket, offload=True, param_offload=[0, 1, 3, 4, 6, 7],
                                  prefetch_depth=depth)
    s = unwrap_session(model)
    try:
        losses, most = [], 0
        for t in data:
            s.pager.trace = []
            loss = loss_of(model, t)
            loss.backward()
            most = max(most, schedule.most_in_flight(s.pager.trace))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if reentrant is not True:  # reentrant checkpointing's forward runs without grad: no block stays
                assert s.pager.last_step_h2d_bytes == s.pager.h2d_bytes_per_step
        pb = params_of(model)
    finally:
        trainstream.unwrap(model)
    assert most == depth + 1, f"depth {depth}: {most} blocks on the device at once"
    assert losses == a, f"prefetch_depth={depth}: losses differ: unpaged {a} vs paged {losses}"
    assert_same(pb, pa, f"CUDA prefetch_depth={depth} checkpointing={reentrant}")


@needs_cuda
def test_cuda_auto_on_a_model_that_fits_pages_nothing_and_is_identical(tsd):
    """param_offload="auto" on a model far under the VRAM: the plan pages nothing, no hook is
    installed, the plan settles, and the run equals param_offload=False bit for bit."""
    make = lambda: make_gpt(0, layers=6, d=128)  # noqa: E731
    data = batches(5, batch=8, device="cuda")
    (a, pa, _, _, _), (b, pb, ev, _, moves) = cuda_pair_runs(tsd, make, 5, "auto", data=data)
    assert moves == 0
    assert b == a
    assert_same(pb, pa, "CUDA param_offload='auto' that fits")
    assert any(e.startswith("memory plan: 6 of 6 blocks resident") for e in ev), ev
    assert any(e.startswith("memory plan settled: 6 of 6 blocks resident") for e in ev), ev
    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device="cuda",
                                  socket=tsd.socket, offload=True, param_offload="auto")
    try:
        s = unwrap_session(model)
        assert not s.pager.paged and not s.pager.hooks_installed
        assert not model._forward_pre_hooks  # the pager's model hook (the activation profiler's are on the blocks)
    finally:
        trainstream.unwrap(model)


@needs_cuda
def test_cuda_default_auto_lets_offload_auto_switch_as_without_paging(tsd):
    """wrap()'s defaults on a model that fits (param_offload="auto", offload="auto"): the block
    plan pages nothing and settles after two steps; offload="auto" then switches to stock fused
    AdamW exactly when param_offload=False does, the switch releases the pager (no hook, plain
    parameters on the GPU), and losses and parameters equal the param_offload=False run's bit for
    bit over steps before and after the switch."""
    make = lambda: make_gpt(0, layers=6, d=128).cuda()  # noqa: E731
    data = batches(6, batch=8, device="cuda")

    def run(**kw):
        model = make()
        model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                      socket=tsd.socket, **kw)
        s = unwrap_session(model)
        try:
            losses, offloading, pagers = [], [], []
            for t in data:
                loss = loss_of(model, t)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                offloading.append(opt.offloading)
                pagers.append(s.pager is not None)
            hooks = len(model._forward_pre_hooks) + sum(len(b._forward_pre_hooks) + len(b._forward_hooks)
                                                        for b in model.blocks)
            plain = all(p.is_cuda and p.untyped_storage().nbytes() > 0 for p in model.parameters())
            return losses, params_of(model), list(s.events), offloading, pagers, hooks, plain
        finally:
            if unwrap_session(model) is not None:
                trainstream.unwrap(model)

    a, pa, ea, offa, pagers_a, _, _ = run(param_offload=False)
    b, pb, eb, offb, pagers_b, hooks, plain = run()  # the defaults
    assert offa == offb == [True, False, False, False, False, False], (offa, offb, eb)
    assert pagers_a == [False] * 6 and pagers_b == [True] + [False] * 5
    assert hooks == 0 and plain
    assert any(e.startswith("memory plan settled: 6 of 6 blocks resident") for e in eb), eb
    assert any("switched to stock fused AdamW" in e and "weight pager (nothing paged) was released" in e for e in eb)
    assert b == a
    assert_same(pb, pa, "CUDA defaults (param_offload='auto') with the switch to stock AdamW")


@needs_cuda
def test_cuda_save_and_restore_mid_run_with_paging_equals_an_unpaged_run(tsd):
    """On the GPU: the state of a paged run (blocks 1 and 3, bf16 working weights) saved after 3
    of 6 steps, the run going on, then restored in place (model.load_state_dict() brings the
    paged blocks' weights to the GPU for the load and writes them into their slots;
    load_state_dict() of the optimizer): the continuation equals the unpaged run bit for bit."""
    data = batches(6, batch=8, device="cuda")

    def start(po):
        model = make_gpt(0, layers=4, d=128).cuda()
        return trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP), device="cuda",
                                socket=tsd.socket, offload=True, param_offload=po, param_dtype=torch.bfloat16)

    ref, ref_opt = start(False)
    try:
        want = train(ref, ref_opt, data, 6)
        want_params = params_of(ref)
    finally:
        trainstream.unwrap(ref)
    mine, opt = start([1, 3])
    try:
        assert train(mine, opt, data[:3], 3) == want[:3]
        saved_model = {k: v.clone() for k, v in mine.state_dict().items()}
        saved_opt = opt.state_dict()
        assert train(mine, opt, data[3:5], 2) == want[3:5]
        mine.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
        assert unwrap_session(mine).pager.paged == {1, 3} and storage_bytes(mine.blocks[1]) == 0
        assert train(mine, opt, data[3:], 3) == want[3:]
        assert_same(params_of(mine), want_params, "CUDA save and restore with paging")
    finally:
        trainstream.unwrap(mine)


@needs_cuda
@pytest.mark.parametrize("kind,depth", [("nf4", 1), ("nf4", 2), ("int8", 3)])
def test_cuda_quantized_lora_base_paged_equals_unpaged(tsd, kind, depth):
    """A paged NF4 (and int8) LoRA base on the GPU: codes and absmax copied ahead of use on the copy
    stream, dequantized in the layer as unpaged; losses and parameters equal the unpaged run's bit
    for bit; between steps no paged codes are on the device, and the measured H2D bytes are the
    planned ones."""
    from trainstream import quant as Q
    from trainstream.paging.quantized import PagedQuantizedWeight
    if not Q.has_cuda_kernels():
        pytest.skip("libtsd_quant was built without its CUDA kernels (configure with CUDA to build kernels/cuda)")
    make = lambda: make_qlora(layers=6, d=128, kind=kind, device="cuda")  # noqa: E731
    data = batches(5, batch=8, device="cuda")
    (a, pa, _, _, _), (b, pb, ev, _, moves) = cuda_pair_runs(tsd, make, 5, [0, 2, 3, 5], data=data,
                                                             prefetch_depth=depth)
    assert moves > 0
    assert b == a, f"{kind} depth {depth}: losses differ: unpaged {a} vs paged {b}"
    assert_same(pb, pa, f"CUDA {kind} base paged")
    model = make()
    model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HP),
                                  device="cuda", socket=tsd.socket, offload=True, param_offload=[0, 2, 3, 5],
                                  prefetch_depth=depth)
    s = unwrap_session(model)
    try:
        paged = [q for _, q in quantized_layers(model) if isinstance(q, PagedQuantizedWeight)]
        assert len(paged) == 16
        torch.cuda.synchronize()
        for t in data[:2]:
            loss = loss_of(model, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert all(q.dev_codes is None for q in paged)
        assert s.pager.last_step_h2d_bytes == s.pager.h2d_bytes_per_step > 0
    finally:
        trainstream.unwrap(model)


def test_activation_paging_under_torch_compile_also_when_compiled_before_wrap(tsd):
    """torch.compile and activation paging: the pager's hooks run eagerly around each block's
    compiled forward, whose saved tensors it pages, also for a model compiled and run before
    wrap() (dynamo does not guard on module hooks: its cached code would have skipped them and
    paged nothing). Losses within 1e-6 of the eager paged run."""
    import torch._dynamo

    def run(compile):
        torch._dynamo.reset()
        model = make_gpt(0, d=128, layers=2, seq=64)
        data = batches(4, batch=8, seq=64)
        if compile:  # compiled, and run once, before wrap()
            model.compile()
            loss_of(model, data[0]).backward()
            model.zero_grad()
        opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, activation_offload=True)
        session = trainstream.unwrap_session(model)
        losses, paged = [], []
        try:
            for t in data[1:]:
                session.act_pager.reset_stats()
                loss = loss_of(model, t)
                paged.append(session.act_pager.paged_bytes)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            trainstream.unwrap(model)
        return losses, paged

    try:
        eager, compiled = run(False), run(True)
    finally:
        torch._dynamo.reset()
    assert min(eager[1]) > 0 and min(compiled[1]) > 0, (eager[1], compiled[1])
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6, abs=1e-6)
