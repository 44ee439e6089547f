"""The modes of `dp_bench.py`: what each needs to run, and how each sets up one rank's training
step on the model `dp_bench.py` built (the same weights, seed 0, on the CPU) and the rank's device.

  tsd_dp            `trainstream.wrap(..., distributed=True, offload=True)`: the node's ranks are
                    sessions of one tsd job with one optimizer (one master and one pair of moments
                    per parameter for the node); one rank alone is an ordinary single trainer.
                    `--overlap` adds overlap_forward=True, `--gpu-fraction F` a GPU share of F.
  torchao_dp        torchao's `CPUOffloadOptimizer(AdamW, fused=True)` in every rank, the ranks
                    averaging its host gradients over gloo before `step()`, then clipping them.
  ds_offload_dp     DeepSpeed ZeRO-2 with `offload_optimizer` on the CPU (pinned), bf16, the
                    config of shared/bench/offload_peers.py's ds_offload at a world of N ranks.
  fsdp2_offload_dp  FSDP2 (`fully_shard` on every decoder layer and the root) with
                    `CPUOffloadPolicy` and bf16 compute (`MixedPrecisionPolicy`, fp32 reduction).
  fsdp2_dp          the same without offload: sharded fp32 parameters, gradients and moments in
                    VRAM (the speed reference).

Every mode trains with AdamW (lr 1e-5, weight decay 0.01, fp32 moments) and clips by the global
gradient norm at `--clip` (0: off). A setup returns the rank's step: a function of the rank's
token ids and a `Marks` that runs forward, backward and the optimizer, marks where forward and
backward end, and returns the loss.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Any, Callable, Optional

MODES = ("tsd_dp", "torchao_dp", "ds_offload_dp", "fsdp2_offload_dp", "fsdp2_dp")
CPU_MODES = ("tsd_dp", "fsdp2_dp")  # the modes a --device cpu run can train
NCCL_MODES = ("ds_offload_dp", "fsdp2_offload_dp", "fsdp2_dp")  # their collectives run on the GPUs
NEEDS = {"tsd_dp": ("trainstream",), "torchao_dp": ("torchao",), "ds_offload_dp": ("deepspeed",)}
# What each mode keeps where, in which precision (the record's workload `precision`).
PRECISION = {
    "tsd_dp": "{weights} weights on the GPU, fp32 masters and moments in tsd (one per node), bf16 autocast",
    "torchao_dp": "fp32 weights on the GPU, fp32 copy, gradients and moments on the CPU per rank, bf16 autocast",
    "ds_offload_dp": "bf16 weights on the GPU, fp32 master and moments on the CPU (ZeRO-2 partitions)",
    "fsdp2_offload_dp": "fp32 sharded weights and moments on the CPU, bf16 compute (MixedPrecisionPolicy)",
    "fsdp2_dp": "fp32 sharded weights, gradients and moments on the GPU, bf16 compute (MixedPrecisionPolicy)",
}
LR, WEIGHT_DECAY = 1e-5, 0.01


class Marks:
    """Where one rank's steps spend their time, as finetune_bench breaks a step down: the forward
    and the backward (GPU time between CUDA events on a GPU, wall time on the CPU, which runs them
    synchronously) and the rest of the step (wall time from backward's return to the step's end:
    gradient reduction left over, clipping, the optimizer, and for tsd the wait in step()). A mode's
    step calls `marks("fwd")` when forward returns and `marks("bwd")` when backward does."""

    def __init__(self, cuda: bool) -> None:
        import torch
        self._cuda = cuda
        self._ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        self._t: dict[str, float] = {}
        self.fwd_ms: list[float] = []
        self.bwd_ms: list[float] = []
        self.rest_ms: list[float] = []

    def _at(self, name: str, i: int) -> None:
        self._t[name] = time.perf_counter()
        if self._cuda:
            self._ev[i].record()

    def start(self) -> None:
        self._t.clear()
        self._at("start", 0)

    def __call__(self, name: str) -> None:
        self._at(name, {"fwd": 1, "bwd": 2}[name])

    def end(self) -> None:
        """After the step (the device synchronized): keeps its three spans."""
        t = self._t
        if not {"start", "fwd", "bwd"} <= set(t):
            raise RuntimeError(f"a step marked {sorted(t)}; every mode marks 'fwd' and 'bwd'")
        self.rest_ms.append((time.perf_counter() - t["bwd"]) * 1e3)
        if self._cuda:
            self.fwd_ms.append(self._ev[0].elapsed_time(self._ev[1]))
            self.bwd_ms.append(self._ev[1].elapsed_time(self._ev[2]))
        else:
            self.fwd_ms.append((t["fwd"] - t["start"]) * 1e3)
            self.bwd_ms.append((t["bwd"] - t["fwd"]) * 1e3)


Step = Callable[[Any, Marks], Any]


def precision(mode: str, weights: str) -> str:
    """The workload's description of what `mode` keeps where (tsd_dp's weights per --weights)."""
    return PRECISION[mode].format(weights=weights)


def skip_reason(mode: str, device: str, gpus: Optional[int]) -> Optional[str]:
    """Why `mode` cannot run in this configuration (None if it can): a CPU run of a mode that needs
    CUDA, several ranks of an NCCL mode on one GPU, or a package that is not installed.
    `gpus` is the GPUs of a one-rank-per-GPU run (--gpus), None where the ranks share one."""
    if device == "cpu" and mode not in CPU_MODES:
        return f"needs CUDA (this run is --device cpu; on a CPU: {', '.join(CPU_MODES)})"
    if device == "cuda" and gpus is None and mode in NCCL_MODES:
        return "needs one GPU per rank (--gpus N or --scaling): its NCCL collectives refuse two ranks on one GPU"
    for pkg in NEEDS.get(mode, ()):
        if importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed"
    return None


def average_host_grads(host_params: list[Any], world: int) -> None:
    """All-reduces the host gradients over gloo, flattened into buckets of about 64 MiB."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in host_params if p.grad is not None]
    bucket: list[Any] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        at = 0
        for g in bucket:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
        bucket, size = [], 0

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= 64 << 20:
            flush()
    flush()


def ds_config(batch: int, world: int, clip: float) -> dict[str, Any]:
    """DeepSpeed's config: shared/bench/offload_peers.py's ds_offload (ZeRO-2, the optimizer on the
    CPU in pinned memory, bf16, 200M-element buckets) for `batch` sequences per rank and `world` ranks."""
    return {"train_micro_batch_size_per_gpu": batch, "train_batch_size": batch * world,
            "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "gradient_clipping": clip, "steps_per_print": 1_000_000, "wall_clock_breakdown": False}


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks FSDP2 shards one by one (a Hugging Face causal LM's `model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers to shard")
    return list(layers)


def adamw(params: Any, fused: bool) -> Any:
    """torch's AdamW with the benchmark's settings; fused where the parameters' device supports it."""
    import torch

    params = list(params)
    if fused:
        try:
            return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        except (RuntimeError, ValueError):  # a device or tensor type without the fused kernel
            pass
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def setup(mode: str, model: Any, a: argparse.Namespace, rank: int, world: int, device: str,
          socket: Optional[str]) -> tuple[Step, Any]:
    """Sets `mode` up on one rank: `model` (built on the CPU, identical on every rank) is placed on
    `device` ("cpu", or "cuda" meaning the rank's current CUDA device) and given its optimizer.
    Returns (step, the module whose teardown `teardown` does)."""
    if mode == "tsd_dp":
        return _tsd(model, a, world, device, socket)
    if mode == "torchao_dp":
        return _torchao(model, a, world)
    if mode == "ds_offload_dp":
        return _deepspeed(model, a, rank, world)
    if mode in ("fsdp2_offload_dp", "fsdp2_dp"):
        return _fsdp2(model, a, world, device, offload=mode == "fsdp2_offload_dp")
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def events(mode: str, model: Any) -> list[str]:
    """tsd_dp: the session's event lines (wrap()'s plan, how the gradients cross the group,
    overlap_forward's order); [] for the peers."""
    if mode != "tsd_dp":
        return []
    import trainstream
    session = trainstream.unwrap_session(model)
    return list(session.events) if session is not None else []


def teardown(mode: str, model: Any) -> None:
    """What a mode leaves to undo before the process group goes: tsd's session."""
    if mode == "tsd_dp":
        import trainstream
        trainstream.unwrap(model)


def _tsd(model: Any, a: argparse.Namespace, world: int, device: str, socket: Optional[str]) -> tuple[Step, Any]:
    import torch
    import trainstream

    # On the device first, as finetune_bench's tsd modes do; with --weights bf16 wrap() then takes
    # the fp32 masters from it and leaves bf16 working copies (the fp32 copy is gone before the steps).
    model = model.to(device)
    options: dict[str, Any] = {"param_dtype": torch.bfloat16} if a.weights == "bf16" else {}
    if a.overlap:
        options["overlap_forward"] = True
    if a.gpu_fraction:
        options["optimizer_gpu_fraction"] = a.gpu_fraction
    opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    # One rank alone is a single trainer (distributed=True needs a group of more than one).
    model, opt = trainstream.wrap(model, opt, device=device, socket=socket, distributed=world > 1, offload=True,
                                  moment_dtype="float32", max_grad_norm=a.clip or None, **options)
    autocast = "cuda" if device.startswith("cuda") else "cpu"

    def step(ids: Any, marks: Marks) -> Any:
        with torch.autocast(autocast, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        marks("fwd")
        loss.backward()
        marks("bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model


def _torchao(model: Any, a: argparse.Namespace, world: int) -> tuple[Step, Any]:
    import torch
    from torchao.optim import CPUOffloadOptimizer

    model = model.cuda()
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    host = list(opt.param_d2h_map.values())

    def step(ids: Any, marks: Marks) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        marks("fwd")
        loss.backward()
        marks("bwd")
        torch.cuda.synchronize()  # the hooks' gradient copies to the host are done
        if world > 1:
            average_host_grads(host, world)
        if a.clip:
            torch.nn.utils.clip_grad_norm_(host, a.clip)
        opt.step()
        opt.zero_grad()
        return loss

    return step, model


def _deepspeed(model: Any, a: argparse.Namespace, rank: int, world: int) -> tuple[Step, Any]:
    # DeepSpeed reads the launch from the environment and joins the process group already made.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(a.batch, world, a.clip))

    def step(ids: Any, marks: Marks) -> Any:
        loss = engine(input_ids=ids, labels=ids).loss
        marks("fwd")
        engine.backward(loss)
        marks("bwd")
        engine.step()
        return loss

    return step, engine


def _fsdp2(model: Any, a: argparse.Namespace, world: int, device: str, offload: bool) -> tuple[Step, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)  # moves the shards to the device (or pins them)
    opt = adamw(list(model.parameters()), fused=True)

    def step(ids: Any, marks: Marks) -> Any:
        loss = model(input_ids=ids, labels=ids).loss
        marks("fwd")
        loss.backward()
        marks("bwd")
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model
