"""trainstream: train with optimizer state and AdamW in the TrainStream daemon (tsd).

    import trainstream
    with trainstream.connect() as client:          # $TSD_SOCKET, else tsd's default socket
        print(client.status())
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda")

The package, by responsibility (docs/python.md):
  client     connect(), Client, Region: a session with tsd and the host memory it lends
  store      Store: a weight store, one read-only copy of a checkpoint tsd shares across jobs
  units      sizes ("8GiB") and dtypes, read as tsd reads them
  planner    Budget, Demand, Plan, plan(): a budget in, a plan out (pure)
  memory     HostArena: blocks of host memory over a few large tsd regions
  paging     the activation and weight pagers (activation_offload=, param_offload=)
  blockplan  MemoryPlanner: which blocks param_offload="auto" pages
  engine     Session: the per-step protocol with tsd
  optim      TsdAdamW: the torch.optim.Optimizer facade
  wiring     wrap(), plan_wrap(), unwrap(): a plan first, then applied
  quant      int8/NF4 frozen weights: quantize_tensor, QuantizedLinear, quantize_model
  integrations.huggingface  load_model: a safetensors checkpoint, quantized while read
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from .client import Client, Job, Notice, OptimizerLayout, Region, RegionInfo, Status, connect
from .errors import (AlreadyExists, DaemonUnavailable, FailedPrecondition, InvalidRequest, MemoryCheckFailed, NotFound,
                     PermissionDenied, QuotaExceeded, SessionClosed, Timeout, TsdError)
from .store import Store, StoreInfo, StoreTensor
from .memory import HostArena
from .optim import TsdAdamW
from .planner import Budget, Plan
from .quant import quantize_model
from .units import format_bytes, parse_bytes
from .wiring import plan_wrap, unwrap, unwrap_session, wrap

__version__ = "0.5.0"

__all__ = ["connect", "wrap", "plan_wrap", "unwrap", "unwrap_session", "TsdAdamW", "Client", "Status", "Job",
           "Region", "RegionInfo", "OptimizerLayout", "Notice", "Store", "StoreInfo", "StoreTensor", "HostArena", "Budget", "Plan", "parse_bytes", "format_bytes",
           "quantize_model", "TsdError", "DaemonUnavailable", "InvalidRequest", "QuotaExceeded", "MemoryCheckFailed", "PermissionDenied", "NotFound",
           "AlreadyExists", "FailedPrecondition", "SessionClosed", "Timeout"]
