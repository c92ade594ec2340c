"""A round's failure made every participant's: the quorum's process group aborted by shutting its
connections down (docs/fault_tolerance.md, "How a failure is detected").

A collective waits for data from its peers. Where a peer died, the kernel closes its connections and
every collective that waits on it fails at once; but a participant that saw the failure and went on
to the next quorum keeps its own connections open, and a peer whose collective waits for data from
*it* waits until the collective's timeout. gloo's ``abort`` closes nothing, so this module holds the
process group's TCP connections itself: the sockets its construction opened, duplicated, so that the
ones it holds are the group's even after gloo closed its own descriptors. ``shutdown(SHUT_RDWR)`` on
them ends every pending and later collective of the group here and, through the peers' ends of the
same connections, on every participant that waits on this one: a failure spreads in one hop per
participant instead of one timeout. The listening socket is left alone (gloo's accept loop treats its
shutdown as fatal).

The sockets held are those new after the construction (told apart by inode), which runs in
torchft's quorum thread while the training thread waits for the quorum; a connection another thread
opened meanwhile (a healing peer fetching this group's state) is held too, and an abort would only
end that fetch early: the peer then heals at its next quorum. Linux only (the sockets are found in
``/proc/self/fd``); elsewhere nothing is held and a failure reaches the peers at the collectives' timeout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

FDS = "/proc/self/fd"


def sockets() -> dict[int, str]:
    """This process's open sockets: each descriptor's socket, named by its inode (``socket:[N]``),
    which a socket keeps for its life while a closed descriptor's number is soon given to another
    (none where ``/proc`` is absent)."""
    if not os.path.isdir(FDS):
        return {}
    found = {}
    for name in os.listdir(FDS):
        try:
            target = os.readlink(f"{FDS}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def _connection(fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` where it is a connected stream socket (not a listening one)."""
    try:
        held = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if held.type == socket.SOCK_STREAM and not held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return held
    held.close()
    return None


class Connections:
    """The TCP connections a process group opened at its construction, held until :meth:`close`."""

    def __init__(self, sockets: list[socket.socket] | None = None) -> None:
        self.sockets = sockets or []

    @classmethod
    def opened_since(cls, before: set[str]) -> Connections:
        """The connections opened since the sockets ``before`` (:func:`sockets`' values) were taken:
        told apart by inode, not by descriptor, as the previous process group's descriptors are
        closed while the new one opens its own and their numbers are reused."""
        held = [_connection(fd) for fd, inode in sorted(sockets().items()) if inode not in before]
        return cls([s for s in held if s is not None])

    def shut(self) -> None:
        """Shut every connection down, both ways: pending and later collectives over them fail, here
        and at the peers."""
        for held in self.sockets:
            try:
                held.shutdown(socket.SHUT_RDWR)
            except OSError:  # the peer closed it already
                pass

    def close(self) -> None:
        """Shut the connections down and let them go (the process group is replaced)."""
        self.shut()
        for held in self.sockets:
            held.close()
        self.sockets = []


def abortable_gloo(torchft: Any) -> type:
    """torchft's reconfigurable gloo process group, holding each configuration's connections:
    ``abort_connections()`` shuts the current one's down; a reconfiguration lets the previous one's go
    (shut down first, so that no participant left on it waits).

    Each configuration is formed within ``formation_timeout`` (the store's connection, the exchange
    of addresses and the connections), its collectives then wait up to ``timeout``: the members of a
    quorum form its group together, right after the lighthouse answered them all, so a member that
    takes longer is dead, hung or cut off, and the heartbeats that would tell are not yet exchanged
    (:mod:`~gc_strategy.sync.fault_tolerance.silence`). The formation then fails, the round with it,
    and the next quorum goes on without that member. ``on_forming`` learns the members' heartbeat
    addresses through the same store as the formation's first act, so that a member lost before it
    is found by its lateness, and the silence watches every collective of the group from its first."""

    class ProcessGroupGloo(torchft.process_group.ProcessGroupGloo):
        def __init__(self, timeout: timedelta, formation_timeout: timedelta) -> None:
            super().__init__(timeout=timeout)
            self.formation_timeout = formation_timeout
            self.connections = Connections()
            #: called with each configuration's store, rank and size as the formation's first act
            self.on_forming: Callable[[Any, int, int], None] | None = None

        def configure(self, *args: Any, **kwargs: Any) -> None:
            collectives, self._timeout = self._timeout, self.formation_timeout
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = collectives
            self._pg._get_backend(torch.device("cpu"))._set_default_timeout(collectives)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            self.connections.close()
            before = set(sockets().values())
            if self.on_forming is not None:
                self.on_forming(store, rank, world_size)
            group = super()._create_pg(store, rank, world_size)
            self.connections = Connections.opened_since(before)
            return group

        def abort_connections(self) -> None:
            self.connections.shut()

    return ProcessGroupGloo
