"""torchft, imported where fault tolerance is asked for and quiet by default, and the parts of it
that the project configures: the checkpoint transport a healing group fetches a peer's state by
(docs/fault_tolerance.md)."""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from typing import Any

import torch

#: what to install where torchft is missing
INSTALL_TORCHFT = 'pip install -e ".[ft]" in a checkout of gc_strategy, or pip install "gc-strategy[ft]"'
#: torchft's Python loggers: every quorum, commit and heal at INFO
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
#: torch's warning at each heal, from the peer's state read out of a bytes buffer it does not write to
UNWRITABLE_BUFFER = r"The given buffer is not writable"


def require_torchft() -> Any:
    """The ``torchft`` module with the parts used here imported and quiet (:func:`quiet_torchft`),
    or an error that says how to install it."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's native log (read at its first use): warnings only
    try:
        import torchft
        import torchft.checkpointing.http_transport
        import torchft.process_group
    except ImportError as error:
        missing = "fault_tolerance needs torchft (torch >= 2.7), which is not installed"
        raise ImportError(f"{missing}: {INSTALL_TORCHFT}") from error
    quiet_torchft(torchft)
    return torchft


def quiet_torchft(torchft: Any) -> None:
    """torchft's messages at WARNING and above only, where they come from: its Python loggers
    (about six INFO lines per step and group) where the user left their level unset; torch's
    warning about the read-only buffer a healing state arrives in as a last warning filter, after
    the user's own; and gloo's ``_set_sequence_number_for_group``, which torchft calls for each new
    process group and which, from torch 2.14, does nothing but warn from C++ (beyond any Python
    filter) that it is deprecated, not called. Turning them on again: docs/fault_tolerance.md."""
    for name in TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=UNWRITABLE_BUFFER, append=True)
    module = torchft.process_group
    if torch.__version__ >= "2.14" and not getattr(module.BaseProcessGroupGloo, "skips_sequence_number", False):

        class ProcessGroupGloo(module.BaseProcessGroupGloo):
            """Gloo's process group without the deprecated no-op that warns."""

            skips_sequence_number = True

            def _set_sequence_number_for_group(self) -> None:
                pass

        module.BaseProcessGroupGloo = ProcessGroupGloo


def checkpoint_transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (how a healing group fetches a peer's state), advertised
    at ``host``: torchft's own advertises the machine's host name, which peers on another network
    (a namespace, a container) may not reach. Its server writes no access line per request to
    stderr (http.server's default)."""

    class Transport(torchft.checkpointing.http_transport.HTTPTransport):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            handler = self._server.RequestHandlerClass
            self._server.RequestHandlerClass = type(handler.__name__, (handler,), {"log_message": _no_access_log})

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def _no_access_log(handler: Any, format: str, *args: Any) -> None:
    """http.server's access line, not written (errors still reach torchft's logger)."""
