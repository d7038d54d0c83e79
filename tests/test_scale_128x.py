"""The 128x launcher's fan-out: `scripts/run_bert_5b_128x.sh`, with only the documented HL_* overrides (a tiny model
on the CPU, fp32, ZeRO-2 as the launcher's), across its own 16 servers: 16 test hosts (tests/multihost.py, a set of
its own, tag "x") of SLOTS ranks each. The preflight, pdsh and the rendezvous reach all 16, the job trains and
saves; a SIGTERM to the launcher stops every rank on every host with a checkpoint; the supervisor, losing 2 of
the 16 hosts, resumes on the 14 that remain and finishes.

SLOTS = 2, what memory allows: a rank of the tiny model holds about 480 MB of private memory (docs/results.md),
some 165 MB of it freed memory that the driver keeps for the next step (training/device_setup.py), and each host
runs a DeepSpeed launcher of about 160 MB. Here the ranks give freed memory back (MALLOC_TRIM_THRESHOLD_, glibc's
default, in .deepspeed_env: a user's setting wins over the driver's): about 315 MB each, so the 32 ranks and 16
launchers take about 13 GB beside the other work of this shared 24 GiB machine; 3 per host (48 ranks) would not
fit (docs/several-servers.md, "Rehearsed on 16 servers"). Marker `scale` (not in CI: minutes per launch of 32
ranks on 2 cores): bash scripts/run_tests.sh tests/test_scale_128x.py -m scale (root, as the other multi-host
tests).

The global batch keeps the supervisor's choice honest: training/supervisor.usable_hosts takes the most hosts
that pass its checks whose ranks divide the global batch. GLOBAL_BATCH = 224 (micro-batch 1) is the least
multiple of 32 and 28 ranks: 7 accumulation steps on 16 hosts, 8 on 14. With 32 it would be 8 hosts
(16 ranks, the most below 14 hosts that divide 32).
"""

import math
import signal
import subprocess

import pytest

import helpers
import multihost
from test_multihost import DEEPSPEED_ENV, launcher_env, losses, wait_for
from test_supervisor import latest, runs_of
from training.run_status import ExitStatus

pytestmark = [pytest.mark.slow, pytest.mark.scale]

HOSTS, SLOTS, LOST = 16, 2, 2
GLOBAL_BATCH = math.lcm(HOSTS * SLOTS, (HOSTS - LOST) * SLOTS)
MAX_STEPS, SAVE_EVERY = 6, 2
SCRIPT_128X = helpers.REPO_ROOT / "scripts" / "run_bert_5b_128x.sh"
START_TIMEOUT_S = 900  # 32 ranks importing torch and DeepSpeed on 2 cores, beside other work


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """HOSTS test hosts 10.200.0.1-HOSTS of their own (tag "x"), torn down at the end of the module."""
    reason = multihost.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with multihost.TestHosts(tmp_path_factory.mktemp("hosts_128x"), count=HOSTS, tag="x") as test_hosts:
        yield test_hosts


@pytest.fixture(scope="module")
def job(tmp_path_factory, hosts):
    """Shards for MAX_STEPS steps of GLOBAL_BATCH, the DeepSpeed JSON (fp32, ZeRO-2, micro-batch 1), the hostfile
    of HOSTS x SLOTS and a HOME with .deepspeed_env (freed memory given back: the module's docstring)."""
    root = tmp_path_factory.mktemp("job_128x")
    helpers.write_synthetic_shards(root / "data", [GLOBAL_BATCH * 3, GLOBAL_BATCH * 3, GLOBAL_BATCH * 3 - 7])
    home = root / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(f"{DEEPSPEED_ENV}MALLOC_TRIM_THRESHOLD_=131072\n")
    return {"root": root, "data": root / "data", "home": home,
            "ds_config": helpers.write_ds_config(root / "ds_zero2.json", stage=2, bf16=False, micro=1,
                                                 world=GLOBAL_BATCH),
            "hostfile": hosts.hostfile(root / "hostfile", hosts=HOSTS, slots=SLOTS)}


def start(hosts, job, results, **overrides):
    """The 128x launcher on the first host, its output in results.log: (process, log path)."""
    env = launcher_env(hosts, job, results, nodes=HOSTS, ranks_per_node=SLOTS, HL_MAX_STEPS=str(MAX_STEPS),
                       HL_NUM_STEPS_PER_CP=str(SAVE_EVERY), **overrides)
    log = results.parent / f"{results.name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(hosts.command_on(0, ["bash", SCRIPT_128X, "--max_predictions_per_seq=5",
                                                        "--collective_timeout_s=60",
                                                        f"--peak_tflops={helpers.TEST_PEAK_TFLOPS}"]),
                                   env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, log


def ranks_by_host(hosts) -> list:
    return [len(hosts.rank_pids(host)) for host in range(HOSTS)]


def checkpoint_files(directory) -> int:
    return len(list(directory.glob("*_optim_states.pt")))


def rank_costs(dllogger_json) -> list:
    return [r["data"] for r in helpers.read_dllogger(dllogger_json) if r.get("step") == "RANK_COSTS"]


@pytest.mark.timeout(START_TIMEOUT_S + 300)
def test_the_128x_launcher_reaches_every_host_and_a_sigterm_stops_every_rank_with_a_checkpoint(hosts, job):
    """16 hosts x SLOTS ranks: the preflight answers for 16 hosts; every host runs SLOTS ranks (its namespace's
    processes); the job saves at step 2; SIGTERM to the launcher (the supervisor, restarts on): every rank on
    every host stops after the same step with a checkpoint of all the ranks, exit 3 (STOPPED), no restart. (The
    hosts share the machine's process table: scripts/signal_ranks.sh on any one host finds every host's ranks.)"""
    results = job["root"] / "sigterm"
    process, log = start(hosts, job, results, HL_MAX_RESTARTS="2")
    try:
        wait_for(lambda: latest(results) >= SAVE_EVERY, process, timeout=START_TIMEOUT_S)
        running = ranks_by_host(hosts)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    assert status == ExitStatus.STOPPED, output[-4000:]
    assert running == [SLOTS] * HOSTS, running
    assert f"preflight: {HOSTS} hosts answer over ssh" in output
    assert f"global batch {GLOBAL_BATCH} = micro-batch 1 x {GLOBAL_BATCH // (HOSTS * SLOTS)} accumulation steps x " \
           f"{HOSTS * SLOTS} ranks" in output
    assert output.count("deepspeed --num_nodes") == 1  # one attempt
    assert not any(line.startswith(("supervisor:", "error: supervisor:")) for line in output.splitlines())
    stopped = max(losses(results / "dllogger.json"))
    assert SAVE_EVERY < stopped < MAX_STEPS and latest(results) == stopped
    saved = results / "checkpoints" / str(stopped)
    assert checkpoint_files(saved) == HOSTS * SLOTS
    assert {p.name for p in saved.glob("state_*.pt")} == {f"state_{r}.pt" for r in range(HOSTS * SLOTS)}
    summary = [r["data"] for r in helpers.read_dllogger(results / "dllogger.json") if r.get("step") == []][-1]
    assert summary["stopped_by_signal"] is True
    assert ranks_by_host(hosts) == [0] * HOSTS
    [costs] = rank_costs(results / "dllogger.json")
    assert costs["ranks"] == HOSTS * SLOTS
    print(f"per rank: private memory {costs['private_mb_mean']:.0f} MB (at most {costs['private_mb_max']:.0f}), "
          f"peak resident {costs['peak_resident_mb_mean']:.0f} MB (at most {costs['peak_resident_mb_max']:.0f}); "
          f"from the first rank's start to the last's first step: "
          f"{costs['engine_ready_unix_last'] - costs['process_start_unix_first']:.0f} s")  # pytest -s


@pytest.mark.timeout(2 * START_TIMEOUT_S + 300)
def test_the_supervisor_losing_2_of_16_hosts_resumes_on_the_14_that_remain(hosts, job):
    """After the checkpoint of step 2, the last 2 hosts are lost (every process in them killed, their sshd and
    ranks too): the supervisor leaves them out and resumes from that checkpoint on the 14 others (28 ranks,
    the same global batch), which finish the run."""
    results = job["root"] / "lost"
    process, log = start(hosts, job, results, HL_MAX_RESTARTS="2")
    lost = list(range(HOSTS - LOST, HOSTS))
    try:
        wait_for(lambda: latest(results) >= SAVE_EVERY, process, timeout=START_TIMEOUT_S)
        for host in lost:
            hosts.lose(host)
        status = process.wait(timeout=START_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
        for host in lost:  # the fixture's teardown ends what runs in them; sshd back keeps the hosts usable
            if not hosts.pids(hosts.namespaces[host]):
                hosts.restart_sshd(host)
    output = log.read_text()
    assert status == 0, output[-4000:]
    restarts = [line for line in output.splitlines() if line.startswith("supervisor: restart")]
    assert len(restarts) == 1, output[-4000:]
    remaining, gone = hosts.addresses[:HOSTS - LOST], hosts.addresses[HOSTS - LOST:]
    events = [r["data"] for r in helpers.read_dllogger(results / "dllogger.json") if r.get("step") == "SUPERVISOR"]
    assert [(e["hosts"], sorted(e["hosts_left"])) for e in events] == [(remaining, gone)], events
    assert all(f"host {address}: ssh failed" in events[0]["hosts_left"][address] for address in gone), events
    resumed_from = int(events[0]["resume_from_checkpoint"])
    assert f"on {HOSTS - LOST} host(s) {','.join(remaining)}; left out: " in restarts[0]
    ranks_left = (HOSTS - LOST) * SLOTS
    assert f"global batch {GLOBAL_BATCH} = micro-batch 1 x {GLOBAL_BATCH // ranks_left} accumulation steps x " \
           f"{ranks_left} ranks" in output
    runs = runs_of(results / "dllogger.json")
    assert len(runs) == 2 and sorted(runs[1]) == list(range(resumed_from + 1, MAX_STEPS + 1)), runs
    assert latest(results) == MAX_STEPS and checkpoint_files(results / "checkpoints" / str(MAX_STEPS)) == ranks_left
    assert all(math.isfinite(loss) for loss in runs[1].values())
    assert not any(hosts.rank_pids(host) for host in range(HOSTS))
