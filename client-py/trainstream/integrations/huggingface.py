"""`load_model`: a Hugging Face causal-LM checkpoint of `.safetensors` files, quantized while read.

The model is built on the meta device (its parameters hold no memory; buffers such as rotary
tables are real), then each tensor is read from its shard with `safetensors.safe_open`, one at a
time: a frozen linear weight of the repeated block stack is quantized at once (the CPU kernels)
and its full-precision copy dropped, every other tensor is cast to `dtype` and put in place. So
the full-precision model is never in host memory: the peak is the loaded model plus one tensor.
Checkpoints already quantized by bitsandbytes (NF4, no double quantization: `weight` uint8 codes,
`weight.absmax`, `weight.quant_state.bitsandbytes__nf4`) are read without requantizing; so are
models saved from a quantized model (`QuantizedLinear.state_dict()` writes that layout).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from .. import planner
from ..planner import Budget
from ..progress import progress_enabled
from ..quant.formats import absmax_count, check_block_size, check_kind
from ..quant.linear import QuantizedLinear
from ..quant.model import quantizable_linears
from ..quant.weight import QuantizedWeight
from ..units import format_bytes
from .trainer import TrainStreamMixin, TrainStreamTrainer

__all__ = ["load_model", "choose_quantization", "TrainStreamTrainer", "TrainStreamMixin"]

QUANTIZE = ("auto", "none", "int8", "nf4")
_QUANT_SUFFIXES = (".quant_state.bitsandbytes__nf4", ".quant_state.trainstream__int8")
_AUX = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__fp4")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (moved as each is registered,
    so at most one layer is ever allocated); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _shards(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory: load_model reads a Hugging Face checkpoint directory "
                                f"(config.json and .safetensors files); download one first")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [s for s in files if not os.path.exists(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {path}: {missing[:5]}")
        return [os.path.join(path, s) for s in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors files: load_model reads safetensors checkpoints only "
                                f"(re-save a .bin checkpoint with save_pretrained(..., safe_serialization=True))")
    return [os.path.join(path, f) for f in files]


def _open(shard: str) -> Any:
    from safetensors import safe_open
    try:
        return safe_open(shard, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types (header, size)
        raise ValueError(f"shard {os.path.basename(shard)} is not a readable safetensors file (truncated or "
                         f"corrupt?): {e}") from None


def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def choose_quantization(sizes: dict[str, int], budget_bytes: int) -> Optional[str]:
    """The most precise of None (no quantization), "int8" and "nf4" whose bytes (`sizes`, keyed
    "none", "int8", "nf4") fit in `budget_bytes`; ValueError when not even NF4 fits."""
    for kind in ("none", "int8", "nf4"):
        if sizes[kind] <= budget_bytes:
            return None if kind == "none" else kind
    raise ValueError(f"the model needs {format_bytes(sizes['nf4'])} even as NF4 and the budget is "
                     f"{format_bytes(budget_bytes)}: free host memory, or pass a larger budget_bytes=")


class _Progress:
    """Tensors and bytes read, on stderr when it is a terminal (or as told)."""

    def __init__(self, total_tensors: int, total_bytes: int, enabled: Optional[bool]) -> None:
        self.on = progress_enabled(sys.stderr, enabled)  # a terminal, or $TRAINSTREAM_PROGRESS
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.tensors = self.bytes = 0

    def step(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        if self.on:
            sys.stderr.write(f"\rload_model: {self.tensors}/{self.total_tensors} tensors, "
                             f"{format_bytes(self.bytes)}/{format_bytes(self.total_bytes)}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            sys.stderr.write("\n")


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod, _, leaf = name.rpartition(".")
    return (model.get_submodule(mod) if mod else model), leaf


def _random_like(name: str, p: torch.Tensor, dtype: torch.dtype, std: float, gen: torch.Generator) -> torch.Tensor:
    """load_model's random weight for parameter `name` (shaped like `p`), in host memory: normal(0,
    std) for matrices, drawn by `gen` on its device (a GPU's when one is present: torch draws on the
    CPU in one thread, minutes for a 32B model), ones for norms and zeros for biases."""
    if p.dim() == 1:
        return (torch.zeros if name.endswith("bias") else torch.ones)(p.shape, dtype=dtype)
    t = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=gen.device).mul_(std)
    return t.to("cpu", dtype)


def _host_memory(host: Any, kind: Optional[str], stored: bool, quantized_bytes: int) -> tuple[Any, Optional[str]]:
    """load_model's `host=`: the HostArena quantized weights go to (None: process memory) and,
    for "auto" falling back to process memory, why."""
    from ..client import Client, connect
    from ..errors import DaemonUnavailable, TsdError
    from ..memory import HostArena

    if host is None or kind is None or stored:
        return None, None
    if isinstance(host, HostArena):
        return host, None
    if isinstance(host, Client):
        return HostArena(host, purpose="quantized weights", advice="load_model(host=None) keeps them in process "
                         "memory"), None
    if not (isinstance(host, str) and host == "auto"):
        raise ValueError(f"host must be 'auto', None, a trainstream.Client or a trainstream.memory.HostArena, "
                         f"not {host!r}")
    try:
        client = connect(job=f"load-model-{os.getpid()}")
    except DaemonUnavailable as e:
        return None, f"no tsd answered ({e}); the quantized weights are in this process's memory"
    try:
        room = planner.tsd_budget(client.status(), client.jobs(), client.job, 0).tsd_available
    except TsdError as e:
        room, why = 0, str(e)
    else:
        why = f"{format_bytes(room or 0)} available to this job"
    if room is not None and room < quantized_bytes * 1.05:
        client.close()
        return None, (f"tsd cannot lend the {format_bytes(quantized_bytes)} of quantized weights ({why}); they are "
                      f"in this process's memory")
    arena = HostArena(client, purpose="quantized weights", advice="load_model(host=None) keeps them in process memory")
    setattr(arena, "_ts_owned_by_load", True)
    setattr(arena, "_ts_client", client)
    return arena, None


def load_model(path: Union[str, os.PathLike[str]], quantize: str = "auto", dtype: Optional[torch.dtype] = None,
               random_weights: bool = False, block_size: int = 64, budget: Optional[Budget] = None,
               budget_bytes: Optional[int] = None, ram_fraction: float = 0.9, host: Any = "auto",
               progress: Optional[bool] = None, store: Union[bool, Any] = False,
               **config_overrides: Any) -> nn.Module:
    """Loads the causal LM in `path` (a directory with config.json and .safetensors files, single
    or sharded with model.safetensors.index.json) for LoRA training.

    quantize: "none" (every weight in `dtype`: logits bit-equal to
    `AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`), "int8" or "nf4" (the frozen linear
    weights of the block stack quantized while read, in blocks of `block_size`), or "auto": the
    most precise of those whose bytes fit the host memory budget (`budget_bytes`, else
    `budget.ram_available / budget.processes`, else `ram_fraction` of the available RAM per local
    process; a checkpoint stored quantized stays so). dtype: the compute dtype (default the
    checkpoint's). random_weights=True builds the architecture with random weights and reads none
    (benchmarks of bases not at hand; drawn on the GPU when one is present, a tensor at a time, so
    the same seed gives other values there than on a machine without one).
    config_overrides (e.g. num_hidden_layers=2) change the config; tensors of the checkpoint the
    smaller model has no place for are then skipped.
    host: where quantized weights live. "auto" (the default): in tsd memory when a tsd answers at
    the default socket (`trainstream.connect()`: $TSD_SOCKET, then tsd's default path), through a
    session of its own (job "load-model-<pid>", kept alive by the model as `_ts_host`), else in
    this process's memory (and `_ts_load_info["host_note"]` says why, e.g. no daemon answered or
    it could not lend the bytes); a `trainstream.Client` or a `trainstream.memory.HostArena`: in
    that job's tsd memory (errors are raised then); None: process memory. progress: tensors and
    bytes on stderr (default: when stderr is a terminal).
    store: True (a new `trainstream.connect()` session, job "load-model-<pid>") or an attached
    `trainstream.Client`: the weights come from a tsd weight store of the checkpoint's files
    (docs/stores.md), shared by every process on the node that loads the same checkpoint the same
    way; the first load makes tsd build it, the next ones read no tensor data. Quantized weights
    then live in the store (read-only, never copied); other tensors are copied out of it. The
    model keeps the store (and its client) alive as `_ts_store`.

    The returned model (in eval mode, like from_pretrained's) has `_ts_load_info`: the chosen
    "quantize" (None for none), "quantized_tensors", "prequantized_tensors", "tensors",
    "bytes_read" (and with a store, "store": its id, "store_built": whether this load built it).
    Raises ValueError / FileNotFoundError for an unknown quantize or block size, a
    directory without safetensors, a truncated or corrupt shard (named, with its tensor), or
    tensors that do not match the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize={quantize!r}: use 'auto', 'none', 'int8' or 'nf4'")
    if quantize in ("int8", "nf4"):
        check_block_size(quantize, block_size)
    else:
        check_block_size("nf4", block_size)
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, not {dtype}")
    path = os.fspath(path)
    shards = [] if random_weights else _shards(path)
    if random_weights and not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json to build the architecture from")
    config, unused = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **config_overrides)
    if unused:
        raise ValueError(f"{sorted(unused)} are not fields of {type(config).__name__}: check the overrides")
    if getattr(config, "quantization_config", None) is not None:
        qc = config.quantization_config
        qd = qc if isinstance(qc, dict) else qc.to_dict()
        method = qd.get("quant_method", "bitsandbytes")
        if (method != "bitsandbytes" or qd.get("bnb_4bit_use_double_quant") or qd.get("load_in_8bit")
                or qd.get("bnb_4bit_quant_type", "nf4") != "nf4"):
            shown = {k: v for k, v in qd.items() if "bnb" in k or "load" in k}
            raise ValueError(f"{path} is quantized as {method} ({shown}): load_model reads full-precision "
                             f"checkpoints and bitsandbytes NF4 without double quantization only")
        del config.quantization_config
    if dtype is None:
        cd = getattr(config, "dtype", None)
        dtype = getattr(torch, cd) if isinstance(cd, str) else (cd or torch.float32)
    assert dtype is not None

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    module_names = {id(m): n for n, m in model.named_modules()}
    targets = {(module_names[id(parent)] + "." if module_names[id(parent)] else "") + attr
               for parent, attr, _ in quantizable_linears(model)}
    expected = dict(model.named_parameters())  # tied weights once, under their first name
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(expected)

    # ---- what the checkpoint holds (headers only)
    keys: dict[str, tuple[str, list[int], torch.dtype]] = {}
    if not random_weights:
        for shard in shards:
            with _open(shard) as f:
                for k in f.keys():
                    try:
                        sl = f.get_slice(k)
                        keys[k] = (shard, list(sl.get_shape()), getattr(torch, _ST_DTYPES.get(sl.get_dtype(), "uint8")))
                    except Exception as e:
                        raise ValueError(f"shard {os.path.basename(shard)}: tensor {k}: cannot read its header: "
                                         f"{e}") from None
    prequant = {k[: -len(s)] for k in keys for s in _QUANT_SUFFIXES if k.endswith(s)}
    for w in prequant:
        if w + ".nested_absmax" in keys:
            raise ValueError(f"{w} is double-quantized (bitsandbytes' nested absmax): load_model reads NF4 without "
                             f"double quantization only")

    # ---- quantize="auto": bytes of each choice
    q_sizes = [expected[n + ".weight"].numel() for n in targets if n + ".weight" in expected]
    q_numel = sum(q_sizes)
    q_blocks = sum(absmax_count(n, block_size) for n in q_sizes)
    full = sum(p.numel() for p in expected.values()) * _bytes_of(dtype)
    sizes = {"none": full,
             "int8": full - q_numel * _bytes_of(dtype) + q_numel + 4 * q_blocks,
             "nf4": full - q_numel * _bytes_of(dtype) + (q_numel + 1) // 2 + 4 * q_blocks}
    kind: Optional[str]
    if quantize == "auto" and prequant:
        kind = "nf4"  # a checkpoint stored quantized stays as stored (no budget question to answer)
    elif quantize == "auto":
        if budget_bytes is None:
            if budget is not None and budget.ram_available is not None:
                budget_bytes = budget.ram_available // max(1, budget.processes or 1)
            else:
                budget_bytes = int(planner.available_ram_bytes() * float(ram_fraction)) // planner.local_processes()
        kind = choose_quantization(sizes, int(budget_bytes))
    else:
        kind = None if quantize == "none" else check_kind(quantize)

    # ---- check the checkpoint against the config before reading any tensor
    if not random_weights:
        names = {k for k in keys if not any(k.endswith(s) for s in _QUANT_SUFFIXES + _AUX)}
        missing = sorted(set(expected) - names - tied)
        if missing:
            raise ValueError(f"the checkpoint in {path} has no tensors for {len(missing)} parameters of the "
                             f"{type(model).__name__} its config describes, e.g. {missing[:3]}: the tensors do not "
                             f"match config.json")
        unexpected = sorted(n for n in names - set(expected) - tied if not _is_buffer(model, n))
        if unexpected and not config_overrides:
            raise ValueError(f"the checkpoint in {path} has {len(unexpected)} tensors its config has no place for, "
                             f"e.g. {unexpected[:3]}: the tensors do not match config.json")
        for n in names & set(expected):
            shape = list(expected[n].shape)
            got = keys[n][1]
            if n in prequant:
                continue
            if got != shape:
                raise ValueError(f"shard {os.path.basename(keys[n][0])}: tensor {n} has shape {got}; the config "
                                 f"expects {shape}: the tensors do not match config.json")
        read = sorted(names & (set(expected) | {n for n in names if _is_buffer(model, n)}),
                      key=lambda n: (keys[n][0], n))
    else:
        read = list(expected)

    st = None
    if store is not False and store is not None:
        if random_weights:
            raise ValueError("store= maps the weights of a checkpoint; random_weights=True reads none")
        if prequant:
            raise ValueError(f"{path} is stored quantized: a tsd store builds from full-precision checkpoints; "
                             f"load it without store=")
        from ..client import connect
        client = connect(job=f"load-model-{os.getpid()}") if store is True else store
        wanted = [(n, kind is not None and n.endswith(".weight") and n.rpartition(".")[0] in targets) for n in read]
        st = client.open_store(shards, format=kind or "none", block_size=block_size, tensors=wanted)

    q_bytes = sizes[kind] - (sizes["none"] - q_numel * _bytes_of(dtype)) if kind else 0  # codes and absmax
    host, host_note = _host_memory(host, kind, st is not None, q_bytes)
    info: dict[str, Any] = {"quantize": kind, "quantized_tensors": 0, "prequantized_tensors": 0, "tensors": 0,
                            "bytes_read": 0, "host": "tsd" if host is not None else "process"}
    if host_note:
        info["host_note"] = host_note
    bar = _Progress(len(read), sum(math.prod(keys[n][1]) * _bytes_of(keys[n][2]) for n in read) if keys else 0,
                    progress)
    gen = torch.Generator(device="cuda" if random_weights and torch.cuda.is_available() else "cpu").manual_seed(0)
    std = float(getattr(config, "initializer_range", 0.02))
    handles: dict[str, Any] = {}
    try:
        for name in read:
            module_name = name.rpartition(".")[0]
            if random_weights:
                t = _random_like(name, expected[name], dtype, std, gen)
                nbytes = 0
            elif st is not None:
                if st.tensors[name].quantized:
                    codes, absmax = st.quantized(name)
                    assert kind is not None
                    _place_quantized(model, module_name,
                                     QuantizedWeight(codes, absmax, kind, block_size, st.tensors[name].shape, dtype))
                    info["quantized_tensors"] += 1
                    info["tensors"] += 1
                    bar.step(0)
                    continue
                t = st.tensor(name, copy=True)  # parameters may be trained or cast in place
                nbytes = 0
            elif name in prequant:
                q = _read_prequantized(name, keys, handles, expected[name], dtype, None if kind is None else host)
                if kind is None:
                    _place_plain(model, module_name, q.dequantize())
                else:
                    _place_quantized(model, module_name, q)
                info["prequantized_tensors"] += 1
                bar.step(q.nbytes)
                info["tensors"] += 1
                continue
            else:
                shard = keys[name][0]
                f = handles.get(shard)
                if f is None:
                    f = handles[shard] = _open(shard).__enter__()
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"shard {os.path.basename(shard)}: tensor {name} cannot be read (truncated or "
                                     f"corrupt shard?): {e}") from None
                nbytes = t.numel() * t.element_size()
                info["bytes_read"] += nbytes
            if kind is not None and name.endswith(".weight") and module_name in targets:
                try:
                    q = QuantizedWeight.quantize(t, kind, block_size, dtype=dtype, host=host)
                except ValueError as e:
                    where = "" if random_weights else f"shard {os.path.basename(keys[name][0])}: "
                    raise ValueError(f"{where}tensor {name}: {e}") from None
                _place_quantized(model, module_name, q)
                info["quantized_tensors"] += 1
            else:
                _set(model, name, t.to(dtype) if t.is_floating_point() else t,
                     requires_grad=t.is_floating_point())
            del t
            info["tensors"] += 1
            bar.step(nbytes)
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)
        bar.done()
    if host is not None and getattr(host, "_ts_owned_by_load", False):
        setattr(model, "_ts_host", host)  # the arena and its session live as long as the model
    if st is not None:
        info["store"], info["store_built"] = st.id, st.built
        if st.built:
            info["bytes_read"] = sum(math.prod(keys[n][1]) * _bytes_of(keys[n][2]) for n in keys)
        setattr(model, "_ts_store", st)
    if tied:
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(f"the checkpoint in {path} left {len(left)} parameters unset, e.g. {left[:3]}")
    if not random_weights:
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_cfg):
            from transformers import GenerationConfig
            with contextlib.suppress(Exception):
                model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    setattr(model, "_ts_load_info", info)
    return model


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _is_buffer(model: nn.Module, name: str) -> bool:
    try:
        mod, leaf = _resolve(model, name)
    except AttributeError:
        return False
    return leaf in mod._buffers


def _set(model: nn.Module, name: str, t: torch.Tensor, requires_grad: bool) -> None:
    mod, leaf = _resolve(model, name)
    if leaf in mod._buffers:
        mod._buffers[leaf] = t
    else:
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=requires_grad)


def _place_quantized(model: nn.Module, module_name: str, q: QuantizedWeight) -> None:
    parent, attr = _resolve(model, module_name)
    old = getattr(parent, attr)
    if not isinstance(old, nn.Linear) or tuple(old.weight.shape) != tuple(q.shape):
        raise ValueError(f"{module_name} is {type(old).__name__} with a weight of shape "
                         f"{tuple(getattr(old, 'weight', torch.empty(0)).shape)}; the checkpoint's quantized weight "
                         f"has shape {tuple(q.shape)}")
    setattr(parent, attr, QuantizedLinear(q, old.bias))


def _place_plain(model: nn.Module, module_name: str, w: torch.Tensor) -> None:
    """A pre-quantized weight dequantized (quantize="none") into its nn.Linear."""
    parent, attr = _resolve(model, module_name)
    layer = getattr(parent, attr)
    if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != tuple(w.shape):
        raise ValueError(f"{module_name} has no linear weight of shape {tuple(w.shape)}")
    layer._parameters["weight"] = nn.Parameter(w, requires_grad=True)


def _read_prequantized(name: str, keys: dict[str, Any], handles: dict[str, Any], param: torch.Tensor,
                       dtype: torch.dtype, host: Any) -> QuantizedWeight:
    """A bitsandbytes-layout weight (codes, absmax, quant_state JSON) as a QuantizedWeight."""
    def get(k: str) -> torch.Tensor:
        if k not in keys:
            raise ValueError(f"tensor {name} is stored quantized but {k} is missing from the checkpoint")
        shard = keys[k][0]
        f = handles.get(shard)
        if f is None:
            f = handles[shard] = _open(shard).__enter__()
        try:
            return f.get_tensor(k)
        except Exception as e:
            raise ValueError(f"shard {os.path.basename(shard)}: tensor {k} cannot be read: {e}") from None

    state_key = next(name + s for s in _QUANT_SUFFIXES if name + s in keys)
    try:
        state = json.loads(bytes(get(state_key).tolist()).decode())
        kind, bs, shape = str(state["quant_type"]), int(state["blocksize"]), [int(v) for v in state["shape"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"tensor {state_key} is not a quantization state (JSON with quant_type, blocksize, shape): "
                         f"{e}") from None
    if kind not in ("nf4", "int8"):
        raise ValueError(f"tensor {name} is quantized as {kind!r}; load_model reads nf4 (and trainstream's int8)")
    if shape != list(param.shape):
        raise ValueError(f"tensor {name} is quantized with shape {shape}; the config expects {list(param.shape)}")
    if kind == "nf4" and name + ".quant_map" in keys:
        from ..quant.formats import NF4_VALUES
        qm = get(name + ".quant_map").to(torch.float32)
        if not torch.equal(qm, torch.tensor(NF4_VALUES, dtype=torch.float32)):
            raise ValueError(f"tensor {name}: its quant_map is not NF4's 16 code values")
    try:
        return QuantizedWeight.from_buffers(get(name).reshape(-1), get(name + ".absmax").to(torch.float32), kind, bs,
                                            shape, dtype, host=host)
    except ValueError as e:
        raise ValueError(f"tensor {name}: {e}") from None
