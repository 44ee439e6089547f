"""`TrainStreamTrainer`: Hugging Face's `transformers.Trainer` with its optimizer in tsd.

    from trainstream.integrations.huggingface import TrainStreamTrainer
    trainer = TrainStreamTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                 trainstream={"moment_dtype": "bfloat16"})   # wrap() options
    trainer.train()

The integration is `TrainStreamMixin`, a few overrides of Trainer's hooks, so it also composes
with other Trainer subclasses (TRL's `SFTTrainer`: `class SFT(TrainStreamMixin, SFTTrainer)`):

* `create_optimizer` builds the `torch.optim.AdamW` that `args` describes (`optim`, learning
  rate, betas, eps, and weight decay with Trainer's own decay/no-decay grouping); settings tsd
  cannot run are refused when the trainer is built, before anything is allocated.
* `create_scheduler`, which Trainer calls once accelerate has prepared the model and optimizer,
  first hands the optimizer to `trainstream.wrap()` (so accelerate never round-trips the
  daemon's state), then builds the schedule on it.
* `args.max_grad_norm` and `args.gradient_accumulation_steps` become wrap()'s `max_grad_norm` and
  `accumulation_steps`: gradients are streamed into tsd as backward produces them, so Trainer's
  own clipping of `.grad` is turned off, and the logged `grad_norm` is the norm tsd clipped by.
* Checkpoints: tsd writes its optimizer state (safetensors) straight into
  `trainstream_optimizer.safetensors`, a file the trainer opened in the checkpoint directory, next
  to `trainstream_optimizer.json` (the hyperparameters and the layout); `resume_from_checkpoint`
  streams it back. A stock Trainer checkpoint (`optimizer.pt`) is loaded too.
* `overlap_forward` is on by default: step() returns once the updates are handed to tsd and each
  module's next forward waits for its own. A callback from another package could read a parameter
  directly between steps, before its update is copied in, so with one registered it is off (an
  event says so) unless `trainstream={"overlap_forward": ...}` decides. `train()` waits for the
  last step's updates before it returns.
* tsd's events (`Session.events`: the plan, the moment dtype, activation paging, the switch to
  stock AdamW) go into Trainer's logs under the key "trainstream".
* Weight paging (`param_offload`: "auto" by default, or True, a fraction, block indices): a
  model passed on the CPU stays there until training starts, so a model too big for the GPU is
  never moved to it whole: Trainer's `_move_model_to_device` and accelerate's placement of the
  model are skipped, and `wrap()` moves the resident blocks and pages the rest (inputs still go
  to `args.device`). Evaluate or predict after `train()` has started (before it, the model is
  still where it was passed). With "auto" that happens only when the weights would not fit the
  GPU whole (`wrap_places_model`); a model that fits is placed as stock Trainer places it.

The hooks used (`_clip_grad_norm`, `_get_grad_norm`, `_maybe_log_save_evaluate`,
`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`) are those of transformers 5.

Several processes (`torchrun`, `accelerate launch`): the ranks train data parallel through tsd
(wrap()'s `distributed="auto"`, docs/distributed.md): the node's ranks share one optimizer in tsd
and their gradients are reduced once per optimizer step. accelerate still shards the batches and
places the model, but does not wrap it in DistributedDataParallel (which would reduce the
gradients a second time). The checkpoint's optimizer state is written by the process that saves
(Trainer's `should_save`), and on resume the first rank of each node loads it into the node's
optimizer. Weight paging is off under data parallel (not supported with it yet).
"""
from __future__ import annotations

import itertools
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from ..blockplan import ACTIVATION_RESERVE
from ..engine import Session
from ..optim import TsdAdamW, torch_state
from ..planner import measure_device
from ..wiring import OPTIONS, unwrap_session, wrap

__all__ = ["TrainStreamMixin", "TrainStreamTrainer", "STATE_FILE", "STATE_META_FILE"]

logger = hf_logging.get_logger(__name__)

STATE_FILE = "trainstream_optimizer.safetensors"  # tsd's optimizer state in a checkpoint directory
STATE_META_FILE = "trainstream_optimizer.json"    # its hyperparameters and layout
_SCHEDULER_FILE = "scheduler.pt"                   # transformers' name for the schedule's state
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")  # args.optim values that are torch's AdamW
_FROM_ARGS = {"max_grad_norm": "max_grad_norm", "accumulation_steps": "gradient_accumulation_steps"}
_HOOKS = ("_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate", "_save_optimizer_and_scheduler",
          "_load_optimizer_and_scheduler")
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "initial_lr")  # saved beside the state

if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


def _optim_name(args: TrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _parse_optim_args(text: Optional[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").replace(" ", "").split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def _world(args: TrainingArguments) -> int:
    """The processes of this run: Trainer's world size, or the launcher's (WORLD_SIZE)."""
    return max(int(getattr(args, "world_size", 1) or 1), int(os.environ.get("WORLD_SIZE", "1") or 1))


def check_training_args(args: TrainingArguments, distributed: Any = "auto") -> None:
    """Refuses, with what to do instead, the settings tsd cannot train with. Changes nothing.
    `distributed` is the wrap() option: several processes (torchrun, accelerate launch) train
    data parallel through tsd unless it is False."""
    world = _world(args)
    if world > 1 and distributed is False:
        raise NotImplementedError(
            f"this run has {world} processes (torchrun / accelerate launch / a distributed launcher), and "
            f"trainstream={{'distributed': False}} trains in one process: drop distributed=False (the default 'auto' "
            f"trains the ranks data parallel through tsd), or run one process (python train.py)")
    if int(getattr(args, "n_gpu", 0) or 0) > 1:
        raise NotImplementedError(
            f"TrainStreamTrainer trains on one GPU, and {args.n_gpu} are visible (Trainer would use "
            f"nn.DataParallel): set CUDA_VISIBLE_DEVICES to one GPU")
    if args.fp16:
        raise NotImplementedError(
            "fp16=True trains with a GradScaler, which inspects and unscales .grad and skips steps, but under tsd the "
            "gradients are streamed out of .grad during backward and the update runs in the daemon: use bf16=True "
            "(no scaler), or fp32")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise NotImplementedError("TrainStreamTrainer does not combine with DeepSpeed or FSDP: tsd holds the optimizer "
                                  "state itself; remove deepspeed= / fsdp= from the TrainingArguments")
    name = _optim_name(args)
    if name not in ADAMW_OPTIMS:
        raise ValueError(f"args.optim={name!r}: tsd runs AdamW, so TrainStreamTrainer takes optim='adamw_torch' (or "
                         f"'adamw_torch_fused', the same update); use the stock Trainer for other optimizers")
    extra = _parse_optim_args(getattr(args, "optim_args", None))
    if extra.get("amsgrad", "false").lower() not in ("false", "0"):
        raise NotImplementedError("AMSGrad is not supported by tsd's AdamW: remove amsgrad from args.optim_args")
    if extra:
        raise ValueError(f"args.optim_args {sorted(extra)} are not used by AdamW under TrainStreamTrainer; its "
                         f"settings are learning_rate, adam_beta1, adam_beta2, adam_epsilon and weight_decay")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer passed to the trainer that tsd cannot run."""
    if isinstance(optimizer, TsdAdamW):
        return
    if not isinstance(optimizer, torch.optim.AdamW):
        raise TypeError(f"TrainStreamTrainer runs AdamW in tsd; the optimizer passed is {type(optimizer).__name__}. "
                        f"Pass torch.optim.AdamW, or no optimizer (args.optim='adamw_torch' builds it)")
    if any(g.get("amsgrad", False) for g in optimizer.param_groups):
        raise NotImplementedError("AMSGrad is not supported by tsd's AdamW: build the optimizer with amsgrad=False")
    if any(g.get("maximize", False) for g in optimizer.param_groups):
        raise NotImplementedError("maximize=True is not supported by tsd's AdamW: negate the loss instead")


def check_trainstream_options(options: Any) -> dict[str, Any]:
    """The wrap() options given as `trainstream=`: a dict of wrap()'s options (`budget=` among
    them), without the two that come from the TrainingArguments."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"trainstream= takes a dict of trainstream.wrap() options, not {type(options).__name__}")
    taken = sorted(set(options) & set(_FROM_ARGS))
    if taken:
        raise ValueError(f"trainstream={{...}} sets {taken}, which TrainStreamTrainer takes from the TrainingArguments: "
                         f"set " + ", ".join(f"{_FROM_ARGS[k]}=" for k in taken) + " there instead")
    known = (set(OPTIONS) | {"budget"}) - set(_FROM_ARGS)  # budget=: wrap()'s trainstream.Budget
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"trainstream={{...}} has unknown options {unknown}; trainstream.wrap() takes {sorted(known)}")
    return dict(options)


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _save_state(opt: TsdAdamW, path: str) -> int:
    """tsd writes the optimizer's state into `path`, a file opened here, directly (the trainer's
    memory never holds it). Returns its size."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        save = getattr(opt, "save_state", None)  # TsdAdamW's streaming save, where this version has one
        if callable(save):
            return int(save(fd))
        s = opt._session
        s.idle()
        return int(s.handle.save_state(fd))
    finally:
        os.close(fd)


def _same_size(saved: int, here: int) -> bool:
    """Whether a bucket's size in a checkpoint's layout matches this run's. Layouts written before
    paged parameters were counted by their shape hold 0 for them: such an entry matches any size,
    and tsd checks the state file's own sizes against its buckets when it loads."""
    return saved == here or saved == 0


def _same_layout(saved: list[Any], mine: list[list[Any]]) -> bool:
    return len(saved) == len(mine) and all(
        list(a)[:1] == b[:1] and _same_size(int(list(a)[1]), int(b[1])) for a, b in zip(saved, mine))


def _load_state_by_name(opt: TsdAdamW, path: str, buckets: list[Any], model: nn.Module, checkpoint: str) -> None:
    """Loads tsd's state file `path` (bucket b is the parameter named `buckets[b][0]`, of
    `buckets[b][1]` elements) into a run with a GPU share, through `TsdAdamW.load_state_dict`
    (torch's layout; each parameter's state goes to tsd or to the share, wherever it is now). The
    file's tensors are views of a private mapping, not copies. Raises ValueError, changing
    nothing, when the names or sizes are not this run's trained parameters."""
    from .. import _state

    if opt._session.dp is not None:
        raise ValueError(f"{checkpoint} holds tsd's optimizer state file, written with the whole optimizer in tsd, and "
                         f"this data-parallel run keeps part of it on the GPU (optimizer_gpu_fraction): resume with the "
                         f"optimizer_gpu_fraction the checkpoint was written with (none, or 'auto')")
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    slots = opt._session.by_param
    index = {id(p): i for i, p in enumerate(opt._index())}
    # A parameter's shape: a paged one is an empty tensor between uses, its slots keep the shape.
    shapes = {id(p): slots[id(p)].shape if id(p) in slots else p.shape for p in trained.values()}
    named = [(n, trained.get(n)) for n, _ in buckets]
    wrong = [f"{n} ({k} elements there)" for (n, k), (_, p) in zip(buckets, named)
             if p is None or id(p) not in index or not _same_size(int(k), shapes[id(p)].numel())]
    if wrong or len(buckets) != len(trained):
        what = ", ".join(wrong[:3]) or f"{len(buckets)} trained tensors there, {len(trained)} here"
        raise ValueError(f"{checkpoint}'s optimizer state is for other trained parameters ({what}): resume with the "
                         f"same model, the same trainable parameters (LoRA config) and the same TrainingArguments")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        tensors, _ = _state.read(fd)
    finally:
        os.close(fd)
    state = {}
    for b, st in _state.bucket_states(tensors, range(len(named))).items():
        p = named[b][1]
        assert p is not None
        if st[3] != 0:  # never stepped: torch keeps no state
            state[index[id(p)]] = torch_state(st, shapes[id(p)])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    opt.load_state_dict({"state": state, "param_groups": groups})


def _load_state(opt: TsdAdamW, path: str) -> None:
    """tsd reads the optimizer's state from `path` (checked against its layout before anything
    changes). A master that does not round to the model's parameter is taken from the parameter."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        load = getattr(opt, "load_state", None)  # TsdAdamW's streaming load, where this version has one
        if callable(load):
            load(fd)
            return
        s = opt._session
        s.idle()
        s.handle.load_state(fd)
        for ps in s.params:
            p = ps.param.detach()
            if not torch.equal(ps.master.view(p.shape).to(p.dtype), p.cpu()):
                s.sync_master(ps)
            ps.version = ps.param._version
    finally:
        os.close(fd)


def wrap_places_model(param_offload: Any, model: Optional[nn.Module]) -> bool:
    """Whether wrap(), not Trainer, places the model on the device: always for an explicit
    param_offload choice (True, a fraction, block indices); for "auto" (the default) only when
    the weights not on the GPU yet would not fit there whole, in the current GPU's usable VRAM
    less the block planner's activation reserve, or in its free memory (wrap() then moves the
    resident blocks and pages the others). Otherwise Trainer places the model as stock Trainer
    does, and a model that fits trains as without paging."""
    if param_offload is None or param_offload is False:
        return False
    if not (isinstance(param_offload, str) and param_offload == "auto"):
        return True
    if model is None or not torch.cuda.is_available():
        return False
    away = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers())
               if t.device.type != "cuda")
    if not away:
        return False
    budget = measure_device(torch.device("cuda", torch.cuda.current_device()))
    room = min(int((budget.vram_usable or 0) * (1 - ACTIVATION_RESERVE)), budget.vram_free or 0)
    return away > room


def _device_of(model: nn.Module) -> str:
    devices = sorted({str(p.device) for p in model.parameters()})
    return ", ".join(devices) or "no device"


class TrainStreamMixin(_Base):
    """The TrainStream integration for any `transformers.Trainer` subclass: put it first,
    `class MyTrainer(TrainStreamMixin, SomeTrainer)`, and pass `trainstream={...}` (wrap()
    options). See the module's docstring for what each override does."""

    def __init__(self, *args: Any, trainstream: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        missing = [h for h in _HOOKS if not hasattr(Trainer, h)]
        if missing:
            import transformers
            raise RuntimeError(f"this transformers ({transformers.__version__}) has no Trainer.{', '.join(missing)}: "
                               f"TrainStreamTrainer is written against transformers 5 (5.17 is tested)")
        options = check_trainstream_options(trainstream)
        # Refused before Trainer builds anything (it moves the model, starts accelerate).
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        distributed = options.get("distributed", OPTIONS["distributed"])
        if isinstance(given, TrainingArguments):
            check_training_args(given, distributed)
        optimizers = kwargs.get("optimizers")
        if isinstance(optimizers, tuple) and optimizers and optimizers[0] is not None:
            check_optimizer(_inner(optimizers[0]))
        po = options.get("param_offload", OPTIONS["param_offload"])
        # Several processes train data parallel through tsd (wrap(distributed=)): gradients are
        # reduced at step(), so accelerate must not wrap the model in DistributedDataParallel
        # (create_accelerator_and_postprocess), and weights are not paged (not with data parallel yet).
        data_parallel = isinstance(given, TrainingArguments) and _world(given) > 1
        # Read by _move_model_to_device, which Trainer.__init__ calls.
        self._tsd_pages_weights = (not data_parallel
                                   and wrap_places_model(po, kwargs.get("model", args[0] if args else None)))
        super().__init__(*args, **kwargs)
        check_training_args(self.args, distributed)
        if self.optimizer is not None:
            check_optimizer(_inner(self.optimizer))
        cls_kwargs = getattr(self, "optimizer_cls_and_kwargs", None)
        if cls_kwargs is not None:
            cls, kw = cls_kwargs
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.AdamW)) or kw.get("amsgrad"):
                raise TypeError(f"optimizer_cls_and_kwargs names {getattr(cls, '__name__', cls)} {kw}: "
                                f"TrainStreamTrainer runs torch.optim.AdamW without amsgrad in tsd")
        # The Trainer's default is offload=True: checkpoints and grad_norm are then always tsd's.
        self.trainstream_options: dict[str, Any] = {"offload": True, **options}
        # overlap_forward: on unless given, or unless a callback of another package could read
        # parameters between steps (_wrap_into_tsd decides, from the callbacks registered by then).
        self._tsd_overlap_given = "overlap_forward" in options
        self._tsd_events_logged = 0

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train(); then, with overlap_forward, waits for the last step's updates and copies
        them into the model, so the weights read after training (directly, not only through
        forward or a state dict) are the trained ones."""
        out = super().train(*args, **kwargs)
        opt = self._offloading()
        if opt is not None:
            opt.synchronize()
        return out

    # ---- placement: with weight paging, wrap() places the model
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if getattr(self, "_tsd_pages_weights", False):
            logger.info("trainstream: param_offload is on: the model stays on %s until training starts; wrap() moves "
                        "its resident blocks to %s and pages the others", _device_of(model), device)
            return
        super()._move_model_to_device(model, device)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.accelerator.num_processes > 1:
            # Data parallel through tsd: the ranks' gradients are reduced once per step by wrap()'s
            # distributed= (into one optimizer per node), so the model must not be wrapped in
            # DistributedDataParallel, which would all-reduce them again during backward. accelerate's
            # evaluation mode prepares a model as for training (device, mixed precision) without it.
            prepare = self.accelerator.prepare_model

            def prepare_model(model: nn.Module, device_placement: Optional[bool] = None,
                              evaluation_mode: bool = False) -> nn.Module:
                return prepare(model, device_placement=device_placement, evaluation_mode=True)

            self.accelerator.prepare_model = prepare_model  # type: ignore[method-assign]
        if getattr(self, "_tsd_pages_weights", False):
            # accelerate's prepare() would move the whole model to the device (and round-trip the
            # optimizer's state); Trainer moves each batch to args.device itself.
            self.accelerator.device_placement = False

    # ---- the optimizer
    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """torch.optim.AdamW as args describe it, with Trainer's decay/no-decay groups; wrapped
        into tsd once accelerate has prepared it (create_scheduler)."""
        if self.optimizer is None:
            opt_model = self._trained_model() if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            kwargs: dict[str, Any] = {"lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                                      "eps": self.args.adam_epsilon}
            cls_kwargs = getattr(self, "optimizer_cls_and_kwargs", None)
            cls: type = torch.optim.AdamW
            if cls_kwargs is not None:
                cls, extra = cls_kwargs
                kwargs.update(extra)
            kwargs.pop("fused", None)  # the update runs in tsd: torch's kernels are never used
            kwargs.pop("foreach", None)
            self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: Optional[torch.optim.Optimizer] = None) -> torch.optim.lr_scheduler.LRScheduler:
        if optimizer is None:
            self._wrap_into_tsd()
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_into_tsd(self) -> None:
        holder = self.optimizer
        inner = _inner(holder)
        if isinstance(inner, TsdAdamW):
            return
        check_optimizer(inner)
        opts = dict(self.trainstream_options)
        opts["max_grad_norm"] = float(self.args.max_grad_norm or 0.0) or None
        opts["accumulation_steps"] = int(self.args.gradient_accumulation_steps)
        foreign = [] if self._tsd_overlap_given else self._foreign_callbacks()
        if not self._tsd_overlap_given:
            opts["overlap_forward"] = not foreign
        device = self.args.device
        _, wrapped = wrap(self._trained_model(), inner, device=device, **opts)
        if foreign:
            session = unwrap_session(self._trained_model())
            if session is not None:
                session.events.append(
                    f"overlap_forward: off, because callbacks of other packages ({', '.join(foreign)}) may read "
                    f"parameters between optimizer steps, before tsd's updates are copied in; pass "
                    f"trainstream={{'overlap_forward': True}} if they read them only through forward or state_dict()")
        if isinstance(holder, AcceleratedOptimizer):
            holder.optimizer = wrapped
        else:
            self.optimizer = wrapped
        self._tsd_events_logged = 0

    def _foreign_callbacks(self) -> list[str]:
        """The registered callbacks that are not transformers' own (its flow, progress, printer,
        early-stopping and reporting callbacks read metrics, never parameters). Any other may read a
        parameter directly between steps, which overlap_forward would give it before the update."""
        return sorted({type(cb).__name__ for cb in self.callback_handler.callbacks
                       if not type(cb).__module__.startswith("transformers.")})

    def _trained_model(self) -> nn.Module:
        if self.model is None:
            raise ValueError("TrainStreamTrainer needs a model (model= or model_init=)")
        return self.model

    @property
    def trainstream_optimizer(self) -> Optional[TsdAdamW]:
        """The TsdAdamW the trainer steps (None before training has started)."""
        inner = _inner(self.optimizer)
        return inner if isinstance(inner, TsdAdamW) else None

    @property
    def trainstream_session(self) -> Optional[Session]:
        """The wrapped model's tsd session (None before training has started)."""
        return unwrap_session(self.model) if self.model is not None else None

    def _offloading(self) -> Optional[TsdAdamW]:
        opt = self.trainstream_optimizer
        return opt if opt is not None and opt.offloading else None

    # ---- clipping and grad_norm: tsd's
    def _clip_grad_norm(self, model: nn.Module) -> Any:
        # tsd clips inside the update (or, after offload="auto" switched to stock AdamW, TsdAdamW.step does).
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self._offloading() is not None:
            return None  # known after the step: _maybe_log_save_evaluate takes tsd's
        return super()._get_grad_norm(model, grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, model: nn.Module, trial: Any,
                                 epoch: Any, ignore_keys_for_eval: Any, start_time: float,
                                 learning_rate: Optional[float] = None) -> None:
        opt = self._offloading()
        if opt is not None:
            # Only when this step logs: reading it waits for the step's whole commit, which
            # overlap_forward otherwise lets run on during the next forward.
            grad_norm = opt.last_grad_norm if self.control.should_log else None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate)

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        s = self.trainstream_session
        if s is not None and len(s.events) > self._tsd_events_logged:
            new = s.events[self._tsd_events_logged:]
            self._tsd_events_logged = len(s.events)
            for e in new:
                logger.info("trainstream: %s", e)
            cast(dict[str, Any], logs)["trainstream"] = "\n".join(new)
        super().log(logs, start_time)

    # ---- checkpoints
    def _layout(self, opt: TsdAdamW) -> list[list[Any]]:
        """[name, numel] of each bucket (the order of tsd's state file)."""
        names = {id(p): n for n, p in self._trained_model().named_parameters()}
        # ps.shape: a paged parameter is an empty tensor between uses (paging.weights)
        return [[names.get(id(ps.param), f"#{ps.index}"), ps.shape.numel()] for ps in opt._session.params]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._offloading()
        if opt is None or opt._session.share is not None:
            # Everything, or a GPU share (optimizer_gpu_fraction), in torch on the device: the state is
            # saved as the stock Trainer saves it, optimizer.pt in torch's layout (TsdAdamW.state_dict:
            # tsd's part a snapshot, the share's torch's tensors), and loaded through load_state_dict.
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return
        nbytes = _save_state(opt, os.path.join(output_dir, STATE_FILE))
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in _GROUP_KEYS}
                  for g in opt.param_groups]
        meta = {"format": "trainstream.trainer.v1", "state_file": STATE_FILE, "state_bytes": nbytes,
                "moment_dtype": opt.moment_dtype, "steps": opt._session.steps, "param_groups": groups,
                "buckets": self._layout(opt)}
        with open(os.path.join(output_dir, STATE_META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        if self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        state_path = os.path.join(checkpoint, STATE_FILE)
        opt = self._offloading()
        if opt is None or not os.path.isfile(state_path):
            return super()._load_optimizer_and_scheduler(checkpoint)  # optimizer.pt: a stock Trainer's checkpoint
        meta_path = os.path.join(checkpoint, STATE_META_FILE)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            groups, buckets, moment_dtype = meta["param_groups"], meta["buckets"], meta["moment_dtype"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{checkpoint} has {STATE_FILE} but no readable {STATE_META_FILE} ({e}): the checkpoint is "
                             f"incomplete; resume from another one") from None
        if moment_dtype != opt.moment_dtype:
            raise ValueError(f"{checkpoint} holds {moment_dtype} moments and this run chose {opt.moment_dtype}: pass "
                             f"trainstream={{'moment_dtype': {moment_dtype!r}}} to resume from it")
        if opt._session.share is not None:
            # This run keeps part of the optimizer on the GPU (optimizer_gpu_fraction); the file was
            # written with all of it in tsd: it is loaded by parameter name, in torch's layout.
            if len(groups) != len(opt.param_groups):
                raise ValueError(f"{checkpoint}'s optimizer has {len(groups)} parameter groups and this run's "
                                 f"{len(opt.param_groups)}: resume with the same TrainingArguments")
            _load_state_by_name(opt, state_path, buckets, self._trained_model(), checkpoint)
        else:
            mine = self._layout(opt)
            if not _same_layout(buckets, mine) or len(groups) != len(opt.param_groups):
                diff = next((f"{a} there, {b} here" for a, b in zip(buckets, mine) if not _same_layout([a], [b])),
                            f"{len(buckets)} trained tensors there, {len(mine)} here")
                raise ValueError(f"{checkpoint}'s optimizer state is for other trained parameters ({diff}): resume "
                                 f"with the same model, the same trainable parameters (LoRA config) and the same "
                                 f"TrainingArguments")
            _load_state(opt, state_path)  # data parallel: every rank calls it, the node's first rank loads
        for saved, group in zip(groups, opt.param_groups):
            for k, v in saved.items():
                group[k] = tuple(v) if k == "betas" else v
        sched = os.path.join(checkpoint, _SCHEDULER_FILE)
        if os.path.isfile(sched) and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True):
                self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


class TrainStreamTrainer(TrainStreamMixin, Trainer):
    """`transformers.Trainer` with AdamW, clipping, accumulation and the optimizer state in tsd.
    Takes Trainer's arguments plus `trainstream={...}`, the options of `trainstream.wrap()`
    (offload defaults to True here; max_grad_norm and accumulation_steps come from `args`).
    Refuses fp16 (GradScaler), AMSGrad and optimizers other than AdamW. Launched as several
    processes (torchrun, accelerate launch), the ranks train data parallel through tsd."""
