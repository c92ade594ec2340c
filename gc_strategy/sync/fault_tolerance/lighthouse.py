"""Reaching the lighthouse: what cannot change is reported at once, before torchft's manager waits
``timeout_s`` for it (docs/fault_tolerance.md)."""

from __future__ import annotations

import socket
import time
import urllib.parse

from .options import FaultTolerance

#: how long a lighthouse's port may refuse connections before it is reported (one starting with
#: the groups opens it within that)
REFUSED_S = 3.0
#: the heartbeat timeout to start a lighthouse with (``--heartbeat_timeout_ms``; torchft's default is
#: 5 s), at most ``silence_s``: a killed group in the last quorum is waited for until the lighthouse
#: stops counting it, and with two groups always (a lone survivor is less than half of the groups it
#: still hears), so every second of it is a second of a kill's stall. 1 s keeps a kill within 3 s in
#: every phase, a second kill during a heal included; a group whose heartbeats reach the lighthouse
#: later than that (a distant link) needs more; docs/fault_tolerance.md, "How a failure is detected"
HEARTBEAT_TIMEOUT_S = 1.0


class LighthouseUnreachable(ConnectionError):
    """The lighthouse's address refuses connections, does not resolve, or does not answer."""


def reach_lighthouse(options: FaultTolerance) -> None:
    """Connect to ``options.lighthouse`` once, before torchft's manager does, and report at once
    what cannot change: an address that refuses connections (nothing listens there) within
    :data:`REFUSED_S`, a host name that does not resolve at once; an address that does not answer
    (a dropped packet, a host that is down) after ``timeout_s``. torchft's manager would wait
    ``timeout_s`` in every case, then fail naming neither."""
    url = urllib.parse.urlsplit(options.lighthouse)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    start = time.monotonic()
    deadline, refused_since = start + options.timeout_s, None
    fix = "start it first (torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000) or correct lighthouse="
    while True:
        try:
            socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1)).close()
            return
        except socket.gaierror as error:
            raise LighthouseUnreachable(
                f"fault_tolerance: the lighthouse's host {host!r} (lighthouse = {options.lighthouse!r}) is unknown "
                f"({error}); correct lighthouse="
            ) from None
        except ConnectionRefusedError:
            refused_since = refused_since or time.monotonic()
        except OSError:  # no answer yet, or no route
            refused_since = None
        now = time.monotonic()
        if refused_since is not None and (now - refused_since >= REFUSED_S or now >= deadline):
            raise LighthouseUnreachable(
                f"fault_tolerance: the lighthouse at {options.lighthouse} refused the connection for "
                f"{now - refused_since:.1f} s (nothing listens at {host}:{port}); {fix}"
            )
        if now >= deadline:
            raise LighthouseUnreachable(
                f"fault_tolerance: the lighthouse at {options.lighthouse} did not answer within timeout_s = "
                f"{options.timeout_s} s; {fix}"
            )
        time.sleep(0.2)
