"""activation_recompute: blocks recomputed in backward (gradient checkpointing applied by tsd),
alone and beside weight paging, activation paging, accumulation, clipping and overlap_forward;
bit-identical to keeping the activations. CPU here; test_wrap_cuda.py has the CUDA run."""
import copy
import io

import pytest
import torch
from torch import nn

import trainstream
from gpt import Block, make_gpt
from test_weight_paging import assert_same, wrapped_run
from trainstream.paging.recompute import Recomputer, recomputed
from trainstream.wiring import unwrap_session


class Drop(nn.Module):
    """A block with dropout: the recompute must draw the same mask."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(d, d), nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.relu(self.lin(x)))


def counted(blocks):
    """Counts each block's forwards (a pre-hook: the recompute runs the module call again)."""
    runs = [0] * len(blocks)
    for i, blk in enumerate(blocks):
        blk.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


@pytest.mark.parametrize("kw", [
    dict(),
    dict(param_offload=[0, 1], accumulation_steps=2, max_grad_norm=0.05),
    dict(activation_offload=True, overlap_forward=True, max_grad_norm=1.0),
], ids=["alone", "weights-paged-accumulation-clip", "activations-paged-overlap"])
def test_recomputed_blocks_run_twice_and_change_no_bit(tsd, kw):
    """Blocks 0 and 2 of 4 recomputed: each runs its forward twice per micro-batch (the others once),
    and losses and parameters equal the run that keeps every activation, bit for bit. Beside
    activation paging of every block, the recomputed ones are left to checkpointing."""
    steps, micro = 4, kw.get("accumulation_steps", 1)
    seen = {}

    def make():
        m = make_gpt(0, layers=4, d=32)
        seen["runs"] = counted(m.blocks)
        return m

    a, pa, _, _ = wrapped_run(tsd, make, "cpu", steps * micro, **kw)
    assert seen["runs"] == [steps * micro] * 4

    def look(model, s):
        seen["recompute"] = s.recompute.blocks_recomputed
        seen["pager"] = s.act_pager
        assert all(isinstance(b, Block) for b in model.blocks)  # still a Block to isinstance()
        assert [recomputed(b) for b in model.blocks] == [True, False, True, False]

    b, pb, events, s = wrapped_run(tsd, make, "cpu", steps * micro, activation_recompute=[0, 2], after_wrap=look, **kw)
    assert seen["recompute"] == [0, 2]
    assert seen["runs"] == [2 * steps * micro, steps * micro] * 2
    assert b == a
    assert_same(pb, pa, f"activation_recompute=[0, 2] with {kw}")
    assert any("activation_recompute: blocks 0, 2 (2 of 4) are recomputed in backward" in e for e in events), events
    if kw.get("activation_offload"):
        assert seen["pager"] is not None  # every block's pages asked for; the recomputed ones still ran twice
    # unwrap() gave every block its own class back.
    assert s.recompute is None


def test_recompute_draws_the_same_dropout_and_gives_the_class_back():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Drop(16) for _ in range(3))
    ref = copy.deepcopy(blocks)
    x = torch.randn(8, 16)

    def grads(stack, seed):
        torch.manual_seed(seed)
        h = x
        for blk in stack:
            h = blk(h)
        h.square().sum().backward()
        out = [p.grad.clone() for p in stack.parameters()]
        stack.zero_grad(set_to_none=True)
        return out

    r = Recomputer(blocks, [0, 2])
    r.install()
    assert type(blocks[0]).__name__ == "Drop" and recomputed(blocks[0]) and not recomputed(blocks[1])
    assert all(torch.equal(u, v) for u, v in zip(grads(blocks, 5), grads(ref, 5)))
    # Saved whole (torch.save(model)) or deep-copied while swapped: the copy is a plain Drop with
    # the same weights, run once a step.
    buf = io.BytesIO()
    torch.save(blocks, buf)
    buf.seek(0)
    for back in (torch.load(buf, weights_only=False), copy.deepcopy(blocks)):
        assert [type(b) for b in back] == [Drop] * 3 and not any(recomputed(b) for b in back)
        assert all(torch.equal(u, v) for u, v in zip(back.parameters(), blocks.parameters()))
    assert recomputed(blocks[0]) and recomputed(blocks[2])  # the original is still recomputed
    r.remove()
    assert all(type(b) is Drop for b in blocks) and r.blocks_recomputed == []
    # A block its model already recomputes (a Hugging Face layer with gradient_checkpointing on)
    # is left as it is.
    blocks[1].gradient_checkpointing = True
    r = Recomputer(blocks, [1])
    r.install()
    assert r.blocks_recomputed == [] and type(blocks[1]) is Drop
    with pytest.raises(ValueError, match=r"block indices \[3\] are not in \[0, 3\)"):
        Recomputer(blocks, [3])


@pytest.mark.parametrize("bad,says", [
    (1.5, "activation_recompute as a fraction must be in \\(0, 1\\]"),
    ("all", "activation_recompute must be False, True, 'auto'"),
    ([7], "activation_recompute block indices \\[7\\] are not in \\[0, 2\\)"),
])
def test_recompute_options_are_checked(tsd, bad, says):
    model = make_gpt(0, layers=2, d=32)
    before = [type(b) for b in model.blocks]
    with pytest.raises(ValueError, match=says):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         activation_recompute=bad)
    assert [type(b) for b in model.blocks] == before  # nothing changed


def test_recompute_auto_is_the_default_and_needs_activation_offload_auto(tsd):
    """"auto" is the default; asked for by name beside another activation_offload, it is an error
    (it acts on "auto"'s pages only); the default beside another activation_offload does nothing."""
    model = make_gpt(0, layers=2, d=32)
    with pytest.raises(ValueError, match="activation_recompute='auto' recomputes the blocks activation_offload='auto'"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                         activation_offload=True, activation_recompute="auto")
    for kw in (dict(activation_recompute="auto"), dict(), dict(activation_offload=True)):
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                      **kw)
        try:
            s = unwrap_session(model)
            assert s.recompute_auto and s.recompute is None, kw  # nothing until activation_offload="auto" pages
        finally:
            trainstream.unwrap(model)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  activation_recompute=False)
    assert not unwrap_session(model).recompute_auto
    trainstream.unwrap(model)


@pytest.mark.parametrize("room_for", [0, 2])
def test_recompute_auto_recomputes_what_the_first_decision_takes_off_and_brings_back_what_fits(room_for):
    """activation_recompute="auto": the blocks activation_offload="auto"'s first decision takes off
    the device (3 of 4) are recomputed from the next step, none paged, and their host memory goes
    back to tsd; once the plan settles, the last `room_for` the peak has room for keep their
    activations again. The GPU share waits for a step measured after any change. Gradients stay
    bit-identical."""
    from types import SimpleNamespace

    from test_memory_checks import MiB, Tower, TrimsSeen, first_step_paged
    from trainstream import activation_auto
    from trainstream.optim import decide_activation_offload

    torch.manual_seed(0)
    model = Tower()
    ref = copy.deepcopy(model)
    per = 100 * MiB
    session = first_step_paged(model, per, SimpleNamespace(done=True), lambda: 1900 * MiB - room_for * per - per // 2,
                               recompute_auto=True)
    session.arena = TrimsSeen()
    decide_activation_offload(session)
    assert session.act_pager is None and session.activation_host_bytes == 0 and session.arena.trims[-1] == 0
    assert session.recompute.blocks_recomputed == [0, 1, 2] and session.act_refine.recomputing
    assert [recomputed(b) for b in model.layers] == [True, True, True, False]
    assert any("activation_recompute: blocks 0-2" in e and "instead of paging them" in e for e in session.events)
    assert not activation_auto.settled(session)
    session.steps = 2
    activation_auto.maybe_refine(session)
    assert session.act_refine is None and session.act_pager is None
    stays = [0, 1, 2][:3 - room_for]
    assert session.recompute.blocks_recomputed == stays, session.events
    assert [recomputed(b) for b in model.layers] == [i in stays for i in range(4)]
    # Nothing changed at step 2 with no room: settled at once; else one step measures the change.
    assert activation_auto.settled(session) == (room_for == 0)
    said = "keep their saved activations again" if room_for else "the recomputed blocks stay recomputed"
    assert said in session.events[-1], session.events
    session.steps = 3
    assert activation_auto.settled(session)
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    session.recompute.remove()


@pytest.mark.parametrize("room_for", [0, 2])
def test_recompute_auto_recomputes_while_the_weight_plan_refines_and_moves_it_again_only_on_a_change(room_for):
    """The first decision recomputes while the weight plan (param_offload="auto") still refines, so
    the plan settles on the recompute's peak; the refinement after it changes nothing where the peak
    has no room (the plan stays settled and the GPU share decides at once), and where blocks come
    back the plan refines again from the next step and the share waits until it settles."""
    from types import SimpleNamespace

    from test_memory_checks import MiB, Tower, TrimsSeen, first_step_paged
    from trainstream import activation_auto, share_auto
    from trainstream.optim import decide_activation_offload
    from trainstream.planner import Budget, MemoryPlanner

    model = Tower()
    per = 100 * MiB
    plan = MemoryPlanner(Budget(vram_usable=2000 * MiB), [10 * MiB] * 4)
    session = first_step_paged(model, per, plan, lambda: 1900 * MiB - room_for * per - per // 2, recompute_auto=True)
    session.arena = TrimsSeen()
    decide_activation_offload(session)  # after step 1, with the weight plan still refining
    assert session.recompute.blocks_recomputed == [0, 1, 2]
    for _ in range(2):
        plan.observe(1000 * MiB, set())
    assert plan.done
    session.steps = 2
    activation_auto.maybe_refine(session)
    assert session.act_refine is None
    assert plan.done == (room_for == 0), session.events
    again = [e for e in session.events if "memory plan: measured again from the next step (activation_offload=auto "
             "changed what is paged or recomputed after step 2)" in e]
    assert len(again) == (1 if room_for else 0), session.events
    session.auto_share = share_auto.Pending([], frozenset(), "float32")
    session.by_param = {}
    opt = SimpleNamespace(_session=session)
    session.steps = 3
    if room_for:
        assert plan.observe(1000 * MiB, set()) is None  # steady once: the plan is not settled yet
        share_auto.maybe_decide(opt)  # type: ignore[arg-type]
        assert session.auto_share is not None and not plan.done
        session.steps = 4
        assert plan.observe(1000 * MiB, set()) is None
        assert plan.done  # two steady steps
    share_auto.maybe_decide(opt)  # type: ignore[arg-type]
    assert session.auto_share is None
    assert f"optimizer_gpu_fraction=auto after step {session.steps}" in session.events[-1], session.events
    session.recompute.remove()


def test_recompute_auto_keeps_the_pages_of_blocks_with_batch_norm_statistics():
    """A recompute would update BatchNorm's running statistics twice a step: "auto" leaves such
    pages as they are, and says why."""
    from types import SimpleNamespace

    from test_memory_checks import MiB, Tower, TrimsSeen, first_step_paged
    from trainstream import activation_auto
    from trainstream.optim import decide_activation_offload

    model = Tower()
    model.layers[1].append(nn.BatchNorm1d(64))
    session = first_step_paged(model, 100 * MiB, SimpleNamespace(done=True), lambda: 1900 * MiB - 50 * MiB,
                               recompute_auto=True)
    session.arena = TrimsSeen()
    decide_activation_offload(session)
    pager = session.act_pager
    session.steps = 2
    activation_auto.maybe_refine(session)
    assert session.recompute is None and session.act_pager is pager and session.act_refine is None
    assert any("block 1's 3 (BatchNorm1d: its running statistics) would be updated twice a step" in e
               for e in session.events), session.events
    pager.remove()


@pytest.mark.parametrize("lora", [False, True])
def test_recompute_of_hugging_face_layers_is_bit_identical(tsd, lora):
    """A tiny Qwen2 (and under peft LoRA): its decoder layers, recomputed by tsd through their own
    checkpointing (which drops the KV cache the model makes: written again by the recompute, it
    broke the attention's shapes), three steps equal the run that keeps every activation, bit for
    bit, each layer ran twice a step, and unwrap() leaves the layers' own settings as they were."""
    transformers = pytest.importorskip("transformers")

    def make():
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        if lora:
            peft = pytest.importorskip("peft")
            torch.manual_seed(1)
            m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        return m

    data = torch.randint(0, 128, (3, 2, 17), generator=torch.Generator().manual_seed(2))
    out = {}
    for rec in (False, True):
        model = make().train()
        layers = model.get_base_model().model.layers if lora else model.model.layers
        runs = counted(layers)
        model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                               lr=1e-3), device="cpu", socket=tsd.socket,
                                      activation_recompute=rec)
        try:
            if rec:
                assert unwrap_session(model).recompute.blocks_recomputed == [0, 1]
            losses = []
            for t in data:
                loss = model(input_ids=t[:, :-1], labels=t[:, 1:]).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            trainstream.unwrap(model)
        out[rec] = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, list(runs))
        assert all(not recomputed(b) and "_gradient_checkpointing_func" not in b.__dict__ for b in layers)
    (l0, s0, r0), (l1, s1, r1) = out[False], out[True]
    assert r0 == [3, 3] and r1 == [6, 6]
    assert l0 == l1 and s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
