"""``FaultTolerance``: where the lighthouse is and which replica group this launch is, checked as
every configuration is, and what it refuses before any work (docs/fault_tolerance.md)."""

from __future__ import annotations

import socket
from typing import Any

from ...components import Components
from ...registry import Configuration, Option
from ..paths.hierarchy import parse_hierarchy
from .torchft_setup import require_torchft


class FaultTolerance(Configuration):
    """Where the lighthouse is and which replica group this launch is.

    ``lighthouse``: the lighthouse's address (``http://HOST:PORT``; ``torchft_lighthouse`` prints
    it). ``replica_group``: this group's id, 0 to ``groups - 1`` (a group that comes back takes its
    old id); ``groups``: how many the run is planned with, the shards the data is split into
    (:meth:`shard`). ``min_replicas``: the fewest groups a step commits with. ``timeout_s``: the
    bound on a collective, the commit vote, a healing transfer and reaching the lighthouse;
    ``quorum_timeout_s``: on waiting for a quorum, and for a group to come back at the end.
    ``silence_s``: how long a peer of a running round may be unheard (its heartbeats) before the
    round fails as the peer's hang or loss (:mod:`~gc_strategy.sync.fault_tolerance.silence`),
    independent of ``timeout_s``.
    ``host``: the address the peers reach this group's manager and store at (a healing peer fetches
    state from it); None: this machine's host name."""

    OPTIONS = {
        "lighthouse": Option(None, str, help="the lighthouse's address, http://HOST:PORT"),
        "replica_group": Option(None, int, low=0, help="this group's id, 0 to groups - 1"),
        "groups": Option(1, int, low=1),
        "min_replicas": Option(1, int, low=1),
        "timeout_s": Option(30.0, float, low=0, low_open=True),
        "quorum_timeout_s": Option(120.0, float, low=0, low_open=True),
        "silence_s": Option(5.0, float, low=0, low_open=True),
        "host": Option(None, str, optional=True),
    }

    def __init__(self, lighthouse: Any = None, replica_group: Any = None, **options: Any) -> None:
        super().__init__(lighthouse=lighthouse, replica_group=replica_group, **options)
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"FaultTolerance: option 'lighthouse' = {self.lighthouse!r} is invalid; allowed: the lighthouse's "
                "address as http://HOST:PORT (torchft_lighthouse prints it)"
            )
        if self.replica_group >= self.groups:
            raise ValueError(
                f"FaultTolerance: option 'replica_group' = {self.replica_group} is invalid with groups = "
                f"{self.groups}; allowed: 0 to {self.groups - 1}"
            )
        if self.host is None:
            self.host = socket.gethostname()

    def shard(self, rank: int, ranks: int) -> tuple[int, int]:
        """The data shard of rank ``rank`` of this group's ``ranks``, and the shards in all: each
        rank of each group reads its own, shard ``replica_group × ranks + rank`` of ``groups ×
        ranks``. The same index names the rank's state file beside a checkpoint."""
        return self.replica_group * ranks + rank, self.groups * ranks

    def check(self, components: Components, hierarchy: Any = "flat") -> None:
        """Refuse, before any work, what fault tolerance cannot serve: a hierarchy (a replica group
        of several ranks reduces inside the group and exchanges across groups on its own), a
        measured fusion plan (measured with collectives the groups would not all take part in); and
        a missing torchft."""
        if parse_hierarchy(hierarchy) is not None:
            raise ValueError(
                f"fault_tolerance with hierarchy = {hierarchy!r} is invalid; allowed: 'flat' (a replica group of "
                "several ranks reduces inside the group and exchanges across groups on its own)"
            )
        if components.fusion.measured:
            raise ValueError(
                f"fault_tolerance: fusion = {components.fusion.describe()!r} is invalid (its plan is measured with "
                "collectives the groups would not all take part in); allowed: 'bucket_mb:N', 'groups:N', "
                "'layerwise', 'single', 'file:PATH'"
            )
        require_torchft()
