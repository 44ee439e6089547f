"""The planner (pure: a budget in, a plan out) and the daemon's dry run it takes the optimizer's
layout from (Client.plan_optimizer, tsd's PlanOptimizer)."""
import pytest
import torch

import trainstream
from gpt import make_gpt
from trainstream import planner
from trainstream.client import Job, OptimizerLayout, Status
from trainstream.planner import Budget, Demand

MiB = 1 << 20
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def layout(total):
    return OptimizerLayout(state_bytes=total, control_bytes=4096, master_bytes=total // 2, moment_bytes=total // 8,
                           grad_bytes=total // 8, param_bytes=total // 8 - 4096, accum_bytes=0, buckets=((0, 0, 0),))


DEMAND = Demand(parameters=1_000_000, optimizer={"float32": layout(20 * MiB), "bfloat16": layout(16 * MiB)})


def budget(quota=64 * MiB, used=0, pool_free=1 << 30, **kw):
    return Budget(quota=quota, job_used=used, pool_free=pool_free, pool_total=1 << 30, **kw)


def test_moment_dtype_follows_what_tsd_can_lend():
    assert planner.plan(budget(), DEMAND).moment_dtype == "float32"
    p = planner.plan(budget(quota=18 * MiB), DEMAND)
    assert p.moment_dtype == "bfloat16" and p.state_bytes == 16 * MiB and p.available == 18 * MiB
    # The pool's free bytes bound it too, and so does what the job already holds.
    assert planner.plan(budget(pool_free=18 * MiB), DEMAND).moment_dtype == "bfloat16"
    assert planner.plan(budget(quota=30 * MiB, used=12 * MiB), DEMAND).moment_dtype == "bfloat16"
    assert planner.plan(budget(quota=18 * MiB), DEMAND, moment_dtype="float32", check_memory=False).state_bytes \
        == 20 * MiB


def test_refusal_names_each_part_and_what_would_fit():
    with pytest.raises(trainstream.QuotaExceeded) as e:
        planner.plan(budget(quota=18 * MiB), DEMAND, moment_dtype="float32")
    msg = str(e.value)
    for part in ("fp32 master weights 10.00 MiB", "float32 moments 5.00 MiB", "gradient slots", "parameter slots",
                 "needs 20.00 MiB", "available: 18.00 MiB", "moment_dtype='bfloat16' (needs 16.00 MiB)", "quota"):
        assert part in msg, part
    with pytest.raises(trainstream.QuotaExceeded, match="needs 16.00 MiB"):
        planner.plan(budget(quota=8 * MiB), DEMAND)


def test_weights_that_do_not_fit_in_vram_are_refused():
    d = Demand(parameters=10, optimizer=DEMAND.optimizer, device="cuda:0", weights_to_move=900 * MiB,
               weights_on_device=100 * MiB, largest_grad=200 * MiB)
    with pytest.raises(trainstream.QuotaExceeded, match="do not fit on cuda:0"):
        planner.plan(budget(vram_free=1000 * MiB), d)
    assert planner.plan(budget(vram_free=1200 * MiB), d).moment_dtype == "float32"
    assert planner.plan(budget(vram_free=1000 * MiB), d, check_memory=False).moment_dtype == "float32"


def test_budget_merges_given_fields_over_measured_ones_and_checks_them():
    given = Budget(vram_usable=123, quota=5)
    merged = given.merged(Budget(vram_usable=1, vram_total=2, quota=3, pool_free=4))
    assert (merged.vram_usable, merged.vram_total, merged.quota, merged.pool_free) == (123, 2, 5, 4)
    assert Budget(quota=10, job_used=4, pool_free=100).tsd_available == 6
    assert Budget().tsd_available is None
    with pytest.raises(ValueError, match="vram_usable"):
        Budget(vram_usable=-1)
    with pytest.raises(ValueError, match="no quota"):
        planner.plan(Budget(), DEMAND)


def test_tsd_budget_uses_the_existing_job_or_the_quota_it_would_grant():
    st = Status(version="x", uptime_s=0, pool_bytes=1000, used_bytes=300, locked=True, jobs=1, sessions=1,
                max_job_quota_bytes=800, pid=1)
    jobs = [Job(name="a", uid=0, sessions=1, used_bytes=300, quota_bytes=500, regions=2)]
    assert planner.tsd_budget(st, jobs, "a", 0) == Budget(pool_total=1000, pool_free=700, quota=500, job_used=300)
    assert planner.tsd_budget(st, jobs, "b", 0).quota == 800      # the daemon's maximum
    assert planner.tsd_budget(st, jobs, "b", 2000).quota == 800   # capped at it
    assert planner.tsd_budget(st, jobs, "b", 100).quota == 100


def test_stock_adamw_fit_is_arithmetic_on_the_budget():
    extra = planner.stock_adamw_extra_bytes([(10, 2, 4), (5, 4, 4)])
    assert extra == 10 * 2 + 3 * 10 * 4 + 3 * 5 * 4
    assert planner.stock_adamw_fits(100, extra, 1000)[0]
    fits, why = planner.stock_adamw_fits(900, extra, 1000)
    assert not fits and ">" in why
    assert planner.stock_adamw_fits(0, 0, None) == (False, "device is cpu: offloading stays on")


def test_host_measurements():
    ram = planner.available_ram_bytes()
    host = planner.measure_host()
    assert 0 < ram and 0 < host.ram_available <= host.ram_total and host.processes >= 1
    assert planner.measure_device("cpu") == Budget()


def test_local_processes_reads_torchrun_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert planner.local_processes() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert planner.local_processes() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        planner.local_processes()


# ---- the daemon's dry run

def test_plan_optimizer_is_what_registration_charges_and_allocates_nothing(tsd):
    buckets = [(0, 1000, "float32", "float32"), (1, 333, "bfloat16", "bfloat16"), (0, 0, "float16", "float16")]
    with trainstream.connect(socket=tsd.socket) as c:  # no job needed
        fp32 = c.plan_optimizer([HYPER, HYPER], buckets, accumulate=True)
        bf16 = c.plan_optimizer([HYPER, HYPER], buckets, moment_dtype="bfloat16")
        assert c.status().used_bytes == 0 and c.status().jobs == 0
    assert fp32.state_bytes == (fp32.control_bytes + fp32.master_bytes + 2 * fp32.moment_bytes + fp32.grad_bytes
                                + fp32.param_bytes + fp32.accum_bytes)
    assert fp32.accum_bytes == fp32.master_bytes and bf16.accum_bytes == 0
    assert bf16.moment_bytes < fp32.moment_bytes
    assert fp32.buckets[0] == (0, 0, 0) and fp32.buckets[1][0] == 4032  # 1000 fp32 masters, 64-byte aligned
    # What wrap() registers is what its plan (the dry run) said, to the byte.
    model = make_gpt()
    plan = trainstream.plan_wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                 accumulation_steps=2, moment_dtype="bfloat16")
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  accumulation_steps=2, moment_dtype="bfloat16", job="dry-run")
    try:
        with trainstream.connect(socket=tsd.socket) as c:
            assert next(j for j in c.jobs() if j.name == "dry-run").used_bytes == plan.state_bytes
        assert plan.demand.optimizer["bfloat16"].accum_bytes > 0
    finally:
        trainstream.unwrap(model)


def test_plan_optimizer_checks_input_as_registration_does(tsd):
    with trainstream.connect(socket=tsd.socket) as c:
        with pytest.raises(trainstream.InvalidRequest, match="amsgrad"):
            c.plan_optimizer([HYPER], [(0, 10, "float32", "float32")], amsgrad=True)
        with pytest.raises(trainstream.InvalidRequest, match="group"):
            c.plan_optimizer([HYPER], [(3, 10, "float32", "float32")])
        with pytest.raises(trainstream.InvalidRequest, match="F16 moments"):
            c.plan_optimizer([HYPER], [(0, 10, "float32", "float32")], moment_dtype="float16")
        with pytest.raises(trainstream.InvalidRequest, match="dtype must be one of"):
            c.plan_optimizer([HYPER], [(0, 10, "int8", "float32")])
        with pytest.raises(trainstream.InvalidRequest, match="learning rate"):
            c.plan_optimizer([dict(HYPER, lr=-1.0)], [(0, 10, "float32", "float32")])
        with pytest.raises(trainstream.QuotaExceeded, match="cannot fit in the pool"):
            c.plan_optimizer([HYPER], [(0, 1 << 40, "float32", "float32")])
        assert c.status().jobs == 0


def test_plan_wrap_has_no_side_effects(tsd):
    model = make_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters())
    p = trainstream.plan_wrap(model, opt, device="cpu", socket=tsd.socket, param_dtype=torch.bfloat16,
                              budget=Budget(quota=10 * MiB))
    assert p.budget.quota == 10 * MiB and p.budget.pool_total == 1 << 30  # given, then measured
    assert p.moment_dtype == "float32" and p.demand.parameters == sum(x.numel() for x in model.parameters())
    assert "fp32 master weights" in p.describe()
    assert trainstream.unwrap_session(model) is None and not opt.state
    assert all(torch.equal(a, b) and b.dtype == torch.float32 for a, b in zip(before, model.parameters()))
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.status().jobs == 0 and c.status().used_bytes == 0


def test_a_plan_before_the_first_step_counts_cublas_workspaces():
    """torch gives each (cuBLAS handle, stream) its own workspace and each thread its own handle:
    forward and autograd's backward thread make two, 32 MiB each from Hopper on (64 MiB: more
    than half of a 100 MiB cap). A measured peak holds them; the demand wrap() checks before any
    step counts them on a CUDA device (and not on the CPU)."""
    MiB = 1 << 20
    assert planner.blas_workspace_bytes(9) == planner.blas_workspace_bytes(10) == 32 * MiB
    assert planner.blas_workspace_bytes(8) == (4096 * 2 + 16 * 8) * 1024
    assert planner.blas_workspace_bytes(9, ":4096:8") == 32 * MiB
    assert planner.blas_workspace_bytes(8, ":16:8") == 128 * 1024
    assert planner.blas_workspace_bytes(9, ":4096:2:16:8") == (4096 * 2 + 16 * 8) * 1024
    for bad in (":4096", "4096:8", ":x:8", ":4096:-1"):  # torch warns and uses its default: so do we
        assert planner.blas_workspace_bytes(9, bad) == 32 * MiB
    assert planner.BLAS_WORKSPACES_PER_STEP == 2
    model = torch.nn.Linear(8, 8)
    trainable = [(p, 4) for p in model.parameters()]
    layout = planner.OptimizerLayout(state_bytes=1, control_bytes=0, master_bytes=0, moment_bytes=0, grad_bytes=0,
                                     param_bytes=0, accum_bytes=0, buckets=())
    opt = {"float32": layout, "bfloat16": layout}
    on_gpu = planner.model_demand(model, trainable, torch.device("cuda", 0), opt)
    on_cpu = planner.model_demand(model, trainable, torch.device("cpu"), opt)
    assert on_gpu.blas_workspaces == planner.blas_workspaces(torch.device("cuda", 0)) > 0
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert on_gpu.vram_resident == weights + on_gpu.largest_grad + on_gpu.blas_workspaces
    assert on_cpu.blas_workspaces == 0
