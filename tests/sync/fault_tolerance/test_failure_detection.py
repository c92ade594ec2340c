"""How fast the survivors learn of a failure (gc_strategy/sync/fault_tolerance/abort.py, silence.py), tested
for real: three replica groups of tests/ft_worker.py on a lighthouse on loopback, one of them
failing a round alive, killed (SIGKILL) or frozen (SIGSTOP) at moments drawn at random, by the
process ids started here, and started again or woken. ``timeout_s`` stays at its default (30 s)
throughout: every bound below is far under it."""

import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ft_groups import finish, launch, same, start
from locations import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import netns  # noqa: E402

coordination = pytest.importorskip("torchft.coordination")

GROUPS = 3
#: the survivors' longest stall allowed for a kill, and beyond the silence bound for a hang
KILL_STALL_S = 3.0
HANG_MARGIN_S = 1.0
#: the roles of the runs of thousands of steps: PowerSGD (its shared factors healed too); top-k with
#: residual error feedback, at this worker's learning rate, grows without bound over them
ROLES = "powersgd+none"


def committed(log: Path, groups: int = GROUPS) -> int:
    """The steps a group's log says it committed with ``groups`` groups."""
    text = log.read_text() if log.exists() else ""
    return len(re.findall(rf"committed step \d+ with {groups} groups", text))


def wait_for_commits(log: Path, more_than: int, timeout: float = 120) -> int:
    """Wait until ``log`` says more than ``more_than`` steps committed with every group; how many."""
    deadline = time.monotonic() + timeout
    while committed(log) <= more_than:
        assert time.monotonic() < deadline, f"{log.name}: not {more_than + 1} steps with every group in {timeout} s"
        time.sleep(0.05)
    return committed(log)


def end_together(out: Path, groups: list, lead: int = 40) -> list[dict]:
    """Tell every group to end ``lead`` steps after the furthest one's last commit; their results."""
    last = max(int(s) for log in out.glob("*.log") for s in re.findall(r"committed step (\d+)", log.read_text()))
    (out / "steps.tmp").write_text(str(last + lead))
    os.replace(out / "steps.tmp", out / "steps")
    return [finish(process, out, g) for g, process in enumerate(groups)]


def stalls(record: list[dict]) -> list[float]:
    """A group's stalls: each time between two committed steps, less its median step."""
    ends = [r["ended"] for r in record if r["committed"]]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    typical = statistics.median(gaps)
    return [gap - typical for gap in gaps]


def assert_bit_identical(results: list[dict]) -> None:
    for other in results[1:]:
        assert same(results[0]["params"], other["params"])
        assert same(results[0]["optimizer"], other["optimizer"])
        assert other["committed_steps"] == results[0]["committed_steps"]


def start_group(
    lighthouse: str, group: int, out: Path, *extra: str, roles: str = "topk+residual", node: object = None
) -> object:
    """Group ``group`` (``roles``, ``timeout_s`` at its default), training until told to end
    (:func:`end_together`)."""
    compressor, memory = roles.split("+")
    options = ["--steps", "1000000", "--steps-file", str(out / "steps"), "--compressor", compressor, "--memory", memory]
    return start(lighthouse, group, GROUPS, out, *options, "--timeout", "30", *extra, node=node)


@pytest.mark.slow
def test_a_participant_that_fails_a_round_alive_fails_it_at_once_on_every_other(lighthouse, tmp_path):
    """Group 0 fails step 6 (every group in it) alive, as a participant that saw a peer fail does,
    and issues none of the round's collectives: groups 1 and 2 wait in theirs for its data. Its
    process group's connections, shut down at its failure, end their wait at once, not at
    ``timeout_s``: the failed step lasts under 3 s on each, every group redoes it, and all end
    bit-identical."""
    groups = [start_group(lighthouse, g, tmp_path, *(["--fail-at", "6"] if g == 0 else [])) for g in range(GROUPS)]
    wait_for_commits(tmp_path / "0.log", 12)
    results = end_together(tmp_path, groups)
    for result in results:
        failed = [r for r in result["record"] if not r["committed"] and r["participants"] == GROUPS]
        assert len(failed) == 1 and failed[0]["state_kept"]
        assert failed[0]["seconds"] < KILL_STALL_S, failed[0]["seconds"]
    assert_bit_identical(results)


@pytest.mark.slow
def test_a_kill_at_any_moment_stalls_the_survivors_under_3_s(lighthouse, tmp_path):
    """Group 2 is killed (SIGKILL) 3 times, each at a moment drawn at random (steps back to back:
    the moment falls in the forward, the backward, an exchange, the vote, the quorum or the
    healing of its previous restart alike), and started again at once. Every stall of the
    survivors is under 3 s; all end bit-identical."""
    draw = random.Random(63)
    pace = ["--step-pause", "0"]
    groups = [start_group(lighthouse, g, tmp_path, *pace, roles=ROLES) for g in range(GROUPS)]
    for _ in range(3):
        wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
        time.sleep(draw.uniform(0, 0.2))
        os.kill(groups[2].pid, signal.SIGKILL)
        groups[2].wait(timeout=10)
        groups[2] = start_group(lighthouse, 2, tmp_path, *pace, roles=ROLES)
    wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
    results = end_together(tmp_path, groups)
    for survivor in results[:2]:
        assert max(stalls(survivor["record"])) < KILL_STALL_S, sorted(stalls(survivor["record"]))[-5:]
    assert_bit_identical(results)


@pytest.mark.slow
def test_a_frozen_group_is_left_out_after_its_silence_and_heals_when_it_wakes(tmp_path):
    """``silence_s`` = 2 (the lighthouse's heartbeat timeout the same): group 2 is frozen (SIGSTOP)
    twice, each at a moment drawn at random, for 5 s, then woken (SIGCONT). Its connections stay
    open: only its silence tells. Every stall of the survivors is under ``silence_s`` + 1 s; each
    time it wakes it finds itself out, heals and takes part again; all end bit-identical."""
    silence = 2.0
    server = coordination.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=int(silence * 1000)
    )
    try:
        draw = random.Random(632)
        options = ["--step-pause", "0", "--silence", str(silence)]
        groups = [start_group(server.address(), g, tmp_path, *options, roles=ROLES) for g in range(GROUPS)]
        for _ in range(2):
            wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
            time.sleep(draw.uniform(0, 0.2))
            os.kill(groups[2].pid, signal.SIGSTOP)
            time.sleep(silence + 3)
            os.kill(groups[2].pid, signal.SIGCONT)
        wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
        results = end_together(tmp_path, groups)
    finally:
        server.shutdown()
    for survivor in results[:2]:
        assert max(stalls(survivor["record"])) < silence + HANG_MARGIN_S, sorted(stalls(survivor["record"]))[-5:]
    assert_bit_identical(results)


LIGHTHOUSE_SCRIPT = """
import sys, time
from torchft.coordination import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=int(sys.argv[2]))
print("lighthouse up", flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="network namespaces need root and tc")
def test_a_group_cut_off_by_the_network_is_left_out_after_its_silence_and_heals_when_it_is_back(tmp_path):
    """Each group on a node of its own (a network namespace behind a 1 Gbit/s link), the lighthouse
    on node 0, ``silence_s`` = 2. Node 2's link is cut (its bridge port down: every packet dropped,
    no connection closed, no reset) twice, each at a moment drawn at random, for 5 s, and
    restored. Every stall of the survivors is under ``silence_s`` + 1 s; group 2, back on the
    network, heals and takes part again; all end bit-identical."""
    silence = 2.0
    with netns.emulated_network(GROUPS, "1gbit") as nodes:
        address = f"{nodes[0].address}:29510"
        lighthouse = launch(
            [*nodes[0].command, sys.executable, "-c", LIGHTHOUSE_SCRIPT, address, str(int(silence * 1000))],
            tmp_path / "lighthouse.log",
        )
        draw = random.Random(6322)
        options = ["--step-pause", "0", "--silence", str(silence)]
        groups = [
            start_group(f"http://{address}", g, tmp_path, *options, roles=ROLES, node=nodes[g]) for g in range(GROUPS)
        ]
        link = f"{netns.PREFIX}2h"  # node 2's end on the bridge
        for _ in range(2):
            wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
            time.sleep(draw.uniform(0, 0.2))
            subprocess.run(["ip", "link", "set", link, "down"], check=True)
            time.sleep(silence + 3)
            subprocess.run(["ip", "link", "set", link, "up"], check=True)
        wait_for_commits(tmp_path / "2.log", committed(tmp_path / "2.log") + 3)
        results = end_together(tmp_path, groups)
        lighthouse.kill()
    for survivor in results[:2]:
        assert max(stalls(survivor["record"])) < silence + HANG_MARGIN_S, sorted(stalls(survivor["record"]))[-5:]
    assert_bit_identical(results)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by a signal)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_diloco_fails_an_outer_round_frozen_in_within_its_silence_and_loses_no_inner_step(tmp_path):
    """DiLoCo (``inner_steps=5``, ``topk`` + residual), three groups, ``silence_s`` = 2 (the
    lighthouse's heartbeat timeout the same): group 2 freezes itself (SIGSTOP) in the first outer
    exchange from inner step 12 with all three, its Δ half sent, and is woken 5 s later. The
    survivors' round fails within ``silence_s`` + 1 s, state as before it, and is redone as two at
    the same inner step (no inner step lost); group 2, awake, fails its round and heals in a later
    one; all end with the same parameters, outer values, outer optimizer and inner step."""
    silence = 2.0
    server = coordination.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=int(silence * 1000)
    )
    try:
        options = ["--steps", "30", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
        options += ["--barrier", str(tmp_path), "--silence", str(silence), "--timeout", "30"]
        groups = [
            start(server.address(), g, GROUPS, tmp_path, *options, *(["--freeze-at", "12"] if g == 2 else []))
            for g in range(GROUPS)
        ]
        deadline = time.monotonic() + 120
        while not stopped(groups[2].pid):
            assert time.monotonic() < deadline and groups[2].poll() is None, (tmp_path / "2.log").read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(silence + 3)
        os.kill(groups[2].pid, signal.SIGCONT)
        results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    finally:
        server.shutdown()
    for survivor in results[:2]:
        rounds = survivor["record"]
        failed = [r for r in rounds if not r["committed"]]
        assert len(failed) == 1 and failed[0]["participants"] == GROUPS and failed[0]["state_kept"]
        assert failed[0]["seconds"] < silence + HANG_MARGIN_S, failed[0]["seconds"]
        committed = [r["step"] for r in rounds if r["committed"]]
        assert committed == list(range(committed[0], committed[-1] + 1, 5))  # each outer step once
        redone = next(r for r in rounds if r["committed"] and r["step"] == failed[0]["step"])
        assert redone["participants"] == 2
    frozen = results[2]["record"]
    woke = next(i for i, r in enumerate(frozen) if not r["committed"])
    assert any(r["committed"] and r["participants"] == GROUPS for r in frozen[woke:])  # healed, with everyone
    for other in results[1:]:
        for key in ("params", "outer", "outer_optimizer"):
            assert same(results[0][key], other[key]), key
        assert other["inner_step"] == results[0]["inner_step"]
