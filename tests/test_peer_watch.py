"""training/peer_watch.py: a rank whose peer dies ends within seconds, naming it, where gloo alone would wait
out the collective timeout (a send under way when the receiver dies is never woken)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers
from training import peer_watch

WORKER = helpers.REPO_ROOT / "tests" / "peer_watch_worker.py"


def start_watches(world, deaths):
    """world PeerWatch objects in this process, joined over loopback as the ranks join; deaths[rank] collects
    what each would end its process with."""
    port_ready, shared = threading.Event(), {}

    def share_port(port):
        if port:
            shared["port"] = port
            port_ready.set()
        port_ready.wait(10)
        return shared["port"]

    watches = [None] * world

    def join(rank):
        watches[rank] = peer_watch.start(rank, world, [f"host{r}" for r in range(world)], "127.0.0.1", share_port,
                                         10, deaths[rank].append)
    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    return watches


def wait_until(condition, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(peer_watch, "GRACE_S", 0.2)


def test_rank_0_names_a_rank_that_closes_without_goodbye_and_tells_the_others(short_grace):
    deaths = {rank: [] for rank in range(3)}
    watches = start_watches(3, deaths)
    watches[1].connections[0].close()  # as the kernel does for a process that died
    assert wait_until(lambda: deaths[0] and deaths[2])
    assert deaths[0] == ["the connection to rank 1 on host1 broke: that rank died; the job stops"]
    assert deaths[2] == ["rank 1 on host1 died (rank 0 lost its connection to it); the job stops"]
    assert deaths[1] == []


def test_a_rank_that_says_goodbye_is_not_a_death(short_grace):
    deaths = {rank: [] for rank in range(2)}
    watches = start_watches(2, deaths)
    watches[1].leave(goodbye=True)
    watches[1].connections[0].close()
    time.sleep(1.0)  # five grace periods
    assert deaths == {0: [], 1: []}
    watches[0].leave(goodbye=True)


def test_a_rank_that_leaves_during_the_grace_period_says_nothing(short_grace, monkeypatch):
    """Its main thread began to leave with a line of its own (e.g. every rank met a failed checkpoint)."""
    monkeypatch.setattr(peer_watch, "GRACE_S", 2.0)
    in_grace, lost = threading.Event(), peer_watch.PeerWatch._lost

    def noted_lost(self, what, peer):
        in_grace.set()
        lost(self, what, peer)
    monkeypatch.setattr(peer_watch.PeerWatch, "_lost", noted_lost)
    deaths = {rank: [] for rank in range(2)}
    watches = start_watches(2, deaths)
    watches[1].connections[0].close()
    assert in_grace.wait(10)
    watches[0].leave(goodbye=False)
    time.sleep(2.5)
    assert deaths[0] == []


def test_a_world_of_one_has_nothing_to_watch():
    assert peer_watch.start(0, 1, ["host0"], "127.0.0.1", lambda port: port, 10, print) is None


def start_pair(mode, timeout_s, task="send"):
    env = helpers.launcher_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(helpers.free_port()), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, str(WORKER), mode, str(timeout_s), task], cwd=helpers.REPO_ROOT,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": "0"}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    if task == "send":
        for rank in ranks:
            assert rank.stdout.readline().strip() == "ready", rank.stderr.read() if rank.poll() is not None else ""
    return ranks


def largest_send_queue(pid) -> int:
    """The most bytes that process `pid` has written to one of its TCP connections and the peer has not yet
    taken (ss's Send-Q)."""
    lines = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return max([int(line.split()[2]) for line in lines if f"pid={pid}," in line] or [0])


def kill_rank_1_mid_send(ranks):
    """Rank 1 has posted its receive; it is stopped (SIGSTOP) before rank 0 starts the send, so rank 0 writes
    until the sockets' buffers are full and stays in the middle of the send (its queue towards rank 1 holds
    more than a megabyte, which only the payload can fill). Then SIGKILL."""
    os.kill(ranks[1].pid, signal.SIGSTOP)
    ranks[0].stdin.write("go\n")
    ranks[0].stdin.flush()
    assert wait_until(lambda: largest_send_queue(ranks[0].pid) > 2 ** 20), "rank 0's send did not start"
    os.kill(ranks[1].pid, signal.SIGKILL)
    ranks[1].wait()
    return time.monotonic()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (Debian: apt-get install iproute2; .ci/run does)")
@pytest.mark.parametrize("mode", ["watch", "no-watch"])
def test_a_peer_killed_during_a_send_ends_rank_0_within_seconds_only_with_the_watch(mode):
    """The negative control (no-watch) shows gloo's gap: rank 0 is still waiting when the watch would have
    ended it, and only the collective timeout ends it. With the watch, the line is the watch's: gloo says
    nothing. Once a torch release bundles a gloo that wakes such a send, the control fails: the watch is then
    worth less, and this test must say so."""
    timeout_s = 60 if mode == "watch" else 15
    ranks = start_pair(mode, timeout_s)
    try:
        killed = kill_rank_1_mid_send(ranks)
        if mode == "no-watch":
            time.sleep(peer_watch.GRACE_S + 5)
            assert ranks[0].poll() is None, "gloo woke rank 0 by itself: the control no longer shows the gap"
        status = ranks[0].wait(timeout=timeout_s + 30)
        elapsed = time.monotonic() - killed
        errors = [line for line in ranks[0].stderr.read().splitlines() if line.startswith("error:")]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    print(f"{mode}: rank 0 ended {elapsed:.1f} s after rank 1 was killed")  # docs/results.md's figure (pytest -s)
    assert status == 1 and len(errors) == 1, (status, errors)
    host = f"{socket.gethostname()} (127.0.0.1)"
    if mode == "watch":
        assert elapsed < peer_watch.GRACE_S + 10, elapsed
        assert errors[0] == f"error: rank 0 on {host}: the connection to rank 1 on {host} broke: that rank died; " \
                            "the job stops"
    else:
        assert elapsed >= timeout_s - 2, elapsed
        assert "a collective got no answer within --collective_timeout_s 15 s" in errors[0]


@pytest.mark.parametrize("task", ["slow-clean-up", "slow-clean-up-watching"])
def test_a_rank_that_stops_the_watch_before_a_long_clean_up_keeps_its_own_error_line(task):
    """Every rank meets the same error and rank 1 exits at once; rank 0's clean-up outlasts the grace. With
    training/distributed.Job.stop_watching_peers first (run_pretraining.py, before its wait for a checkpoint copy)
    rank 0 ends with its own line; the negative control, which keeps watching, takes rank 1's exit for a death."""
    ranks = start_pair("watch", 60, task)
    try:
        statuses = [rank.wait(timeout=60) for rank in ranks]
        errors = [line for line in ranks[0].stderr.read().splitlines() if line.startswith("error:")]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert statuses == [1, 1] and len(errors) == 1, (statuses, errors)
    if task == "slow-clean-up":
        assert errors == ["error: the same bad input on every rank"]
    else:
        assert "the connection to rank 1 on" in errors[0] and "broke: that rank died" in errors[0]
