"""trainstream: train with optimizer state and AdamW in the TrainStream daemon (tsd).

    import trainstream
    with trainstream.connect() as client:          # $TSD_SOCKET, else tsd's default socket
        print(client.status())
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda")

See docs/python.md.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from .client import Client, Job, Status, connect, parse_bytes
from .errors import (AlreadyExists, DaemonUnavailable, FailedPrecondition, InvalidRequest, NotFound,
                     PermissionDenied, QuotaExceeded, SessionClosed, Timeout, TsdError)
from .wrapper import TsdAdamW, unwrap, unwrap_session, wrap

__version__ = "0.5.0"

__all__ = ["connect", "wrap", "unwrap", "unwrap_session", "TsdAdamW", "Client", "Status", "Job", "parse_bytes", "TsdError", "DaemonUnavailable", "InvalidRequest",
           "QuotaExceeded", "PermissionDenied", "NotFound", "AlreadyExists", "FailedPrecondition", "SessionClosed",
           "Timeout"]
