"""Heartbeats (gc_strategy/sync/fault_tolerance/silence.py) between processes' watchers on loopback:
a beating peer is never found silent; one that stopped is, once, while a round runs only; a member
of a new group that never writes its address is found by its lateness."""

import threading
import time

import pytest
import torch.distributed as dist

from gc_strategy.sync.fault_tolerance.silence import STORE_KEY, ArrivalBound, Heartbeats


class Silences:
    def __init__(self) -> None:
        self.found: list[list] = []
        self.event = threading.Event()

    def __call__(self, peers: list) -> None:
        self.found.append(peers)
        self.event.set()


def test_a_peer_that_stops_beating_is_found_silent_once_and_only_while_a_round_runs():
    silence = 1.0
    silences = Silences()
    watcher = Heartbeats("127.0.0.1", silence, silences)
    peer = Heartbeats("127.0.0.1", silence, lambda peers: None)
    try:
        watcher.watch([watcher.address, peer.address])  # its own address is left out
        peer.watch([watcher.address])
        watcher.arm()
        time.sleep(3 * silence)  # 15 beats: the peer is heard throughout
        assert silences.found == []
        watcher.disarm()
        peer.close()
        time.sleep(2 * silence)  # silent, but no round runs
        assert silences.found == []
        watcher.arm()
        assert silences.event.wait(timeout=30)
        assert silences.found == [[peer.address]]
        time.sleep(2 * silence)  # found once: the watch is disarmed until the next round
        assert len(silences.found) == 1
    finally:
        watcher.close()


def test_the_members_of_a_new_group_learn_each_others_heartbeats_through_its_store():
    """As a quorum's process group is formed, each member writes its heartbeat address into the
    group's store under its rank and reads the others': the watch needs no collective, so it covers
    the group's first collective too. Learned so, a peer that stops beating is found silent."""
    silence = 1.0
    store = dist.HashStore()
    silences = Silences()
    watcher = Heartbeats("127.0.0.1", silence, silences)
    peer = Heartbeats("127.0.0.1", silence, lambda peers: None)
    try:
        learning = threading.Thread(target=peer.exchange, args=(store, 1, 2))
        learning.start()
        watcher.exchange(store, 0, 2)
        learning.join(timeout=30)
        assert store.get(f"{STORE_KEY}/1").decode() == f"{peer.address[0]}:{peer.address[1]}"
        watcher.arm()
        time.sleep(2 * silence)  # the peer beats to the watcher, whose address it read from the store
        assert silences.found == []
        peer.close()
        assert silences.event.wait(timeout=30)
        assert silences.found == [[peer.address]]
    finally:
        watcher.close()


def test_the_arrival_bound_follows_the_recent_waits_between_its_floor_and_the_silence_bound():
    """``silence_s`` before any formation was seen; then ``MARGIN`` × the longest of the last
    ``RECENT`` waits, at least ``FLOOR_S``, at most ``silence_s``; ``silence_s`` for the formation
    after a wait that ran out, and the recent waits again once every member arrived."""
    bound = ArrivalBound(silence_s=5.0)
    assert bound.seconds() == 5.0
    bound.arrived(0.01)
    assert bound.seconds() == ArrivalBound.FLOOR_S
    bound.arrived(0.5)
    bound.arrived(0.1)  # the longest counts
    assert bound.seconds() == ArrivalBound.MARGIN * 0.5
    bound.missed()
    assert bound.seconds() == 5.0
    bound.arrived(0.02)
    assert bound.seconds() == ArrivalBound.MARGIN * 0.5  # the ran-out wait is not learned
    for _ in range(ArrivalBound.RECENT):
        bound.arrived(0.01)
    assert bound.seconds() == ArrivalBound.FLOOR_S  # 0.5 s is no longer recent
    bound.arrived(2.0)
    assert bound.seconds() == 5.0  # at most silence_s


def test_a_member_that_never_writes_its_address_fails_the_formation_at_the_arrival_bound():
    """A member of a new quorum dead before it wrote its heartbeat address leaves nothing to tell:
    once one formation was seen, the others wait the arrival bound (its floor here), not
    ``silence_s``, and the formation fails with a ``TimeoutError`` that names the bound."""
    silence = 5.0
    watcher = Heartbeats("127.0.0.1", silence, Silences())
    peer = Heartbeats("127.0.0.1", silence, lambda peers: None)
    try:
        store = dist.HashStore()
        learning = threading.Thread(target=peer.exchange, args=(store, 1, 2))
        learning.start()
        watcher.exchange(store, 0, 2)
        learning.join(timeout=30)
        assert watcher.arrival.seconds() < silence
        with pytest.raises(TimeoutError, match=f"within {ArrivalBound.FLOOR_S:.2f} s of this one"):
            watcher.exchange(dist.HashStore(), 0, 2)  # the peer never writes into this one
        assert watcher.arrival.seconds() == silence  # the next formation waits for a member merely slow
    finally:
        watcher.close()
        peer.close()
