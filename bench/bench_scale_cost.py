"""How the cost of a pretraining job grows with its ranks and servers: `scripts/run_bert_5b_128x.sh` with only
HL_* overrides (the tiny model on the CPU, fp32, ZeRO-2, micro-batch 1 and no accumulation on every rank: the
global batch grows with the ranks) across test hosts: network namespaces with their own sshd, made by
tests/multihost.py (root only; a set of its own, tag "b").

    python bench/bench_scale_cost.py                    # 1, 8, 16, 32 ranks x 1, 4, 16 servers (about 40 min here)
    python bench/bench_scale_cost.py --ranks 1 --servers 1 --plot /tmp/scale.png     # the smallest (the test's)

Each shape (ranks, servers; ranks a multiple of servers) is launched twice, as a user would: the first launch
trains --steps steps and saves at the last; the same command then resumes from that checkpoint, trains one step
and saves (before them, one launch of 1 rank warms the page cache). Measured:

- launch -> first step: from the launcher's start to rank 0's record of step 1 (the first launch), cut into
  stages by the ranks' own milestones (training/rank_costs.py, the run's RANK_COSTS record): launcher, preflight
  and pdsh/ssh up to the first rank's process start; imports, up to the last rank's; rendezvous; model, engine
  (and, when resuming, the checkpoint load); the first step. The mean CPU seconds each rank spent on its imports,
  rendezvous, engine and per training step (the first launch's last save included) are printed too: a stage
  whose CPU time per rank stays flat does the same work on every rank, and grows in wall time only because N
  ranks share this machine's cores;
- step time: the median of the logged time per step of steps 2..--steps of the first launch;
- checkpoint save (both launches) and load (the second), the slowest rank's;
- memory per rank: the largest private memory and peak resident set of any rank (both launches), and the mean
  private memory after each milestone (what holds it: the imports, the process group, the engine, the training);
  and per server, the private memory of its DeepSpeed launcher (sampled every 2 s).

The ranks give freed memory back to the system (MALLOC_SETTING below, in the ranks' environment and
.deepspeed_env), unlike the driver's default: so 32 ranks and 16 launchers fit in this machine's 24 GiB.

Prints a table, the ratios to the smallest shape side by side, and writes a plot (--plot) and the figures as
JSON (--json). All the shapes run in one invocation, one after the other, so that the ratios come from the same
machine state; on a shared machine, compare ratios rather than seconds. Asserts nothing.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_driver import synthetic_arrays
from data.shard_format import write_shard
from training.rank_costs import private_memory_mb

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = REPO_ROOT / "scripts" / "run_bert_5b_128x.sh"
MODEL_CONFIG = REPO_ROOT / "scripts" / "bert_tiny_config.json"
SEQ_LEN, MAX_PRED = 128, 20  # phase 1's shape, as the launcher's arguments say
# The ranks give freed memory back (glibc's default trim threshold; a user's setting wins over the driver's, which
# keeps it: training/device_setup.py): about 160 MB less per rank of the tiny model, which 32 ranks and 16
# per-server launchers need to fit in this machine's 24 GiB beside other work.
MALLOC_SETTING = "MALLOC_TRIM_THRESHOLD_=131072"
STAGES = ("launch", "imports", "rendezvous", "engine", "first step")
MEMORY_MILESTONES = ("imports_done", "rendezvous_done", "engine_ready", "training_done")  # training/rank_costs.py's


def load_test_hosts():
    """tests/multihost.py, loaded by path: the test hosts are the tests' harness."""
    spec = importlib.util.spec_from_file_location("multihost", REPO_ROOT / "tests" / "multihost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_inputs(work: Path, samples: int) -> dict:
    """Shards of `samples` samples, a HOME whose .deepspeed_env the remote ranks read (one thread each, gloo on
    the hosts' eth0)."""
    (work / "data").mkdir()
    for index, count in enumerate((samples - samples // 2, samples // 2)):
        write_shard(work / "data" / f"bench_training_{index}.hdf5",
                    synthetic_arrays(count, SEQ_LEN, MAX_PRED, vocab_size=30522, seed=index))
    home = work / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(f"OMP_NUM_THREADS=1\nGLOO_SOCKET_IFNAME=eth0\n{MALLOC_SETTING}\n")
    return {"data": work / "data", "home": home}


def ds_config(path: Path, ranks: int) -> Path:
    path.write_text(json.dumps({"train_batch_size": ranks, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
                                "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                                "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}))
    return path


def launch(hosts, inputs: dict, shape_dir: Path, ranks: int, servers: int, steps: int, **overrides) -> tuple:
    """One launch of the 128x launcher on the first host; returns (its start in Unix seconds, its wall seconds)."""
    hostfile = hosts.hostfile(shape_dir / "hostfile", hosts=servers, slots=ranks // servers)
    variables = {"HOME": str(inputs["home"]), "HL_HOSTSFILE": str(hostfile), "HL_NUM_NODES": str(servers),
                 "HL_NGPU_PER_NODE": str(ranks // servers), "HL_DEVICE": "cpu", "HL_DATA_DIR": str(inputs["data"]),
                 "HL_MODEL_CONFIG": str(MODEL_CONFIG), "HL_DS_CONFIG": str(ds_config(shape_dir / "ds.json", ranks)),
                 "HL_RESULTS_DIR": str(shape_dir / "results"), "HL_LOG_FREQ": "1", "HL_MAX_STEPS": str(steps + 1),
                 "HL_NUM_STEPS_PER_CP": "1000", "HL_MAX_RESTARTS": "0", "HL_MASTER_PORT": str(hosts.master_port),
                 "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **dict([MALLOC_SETTING.split("=")]), **overrides}
    env = hosts.env({**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                     **variables})
    # --skip_memory_check: on one server the driver's check divides the machine's memory by the local ranks (1.5
    # GiB each for 16) and the planner foresees 1.9 GiB for a rank of the tiny model, which holds about 0.4 here.
    command = hosts.command_on(0, ["bash", LAUNCHER, "--peak_tflops=1.0", "--skip_memory_check"])
    with open(shape_dir / "launches.log", "a") as log, LauncherMemory(hosts.master_port) as launchers:
        started = time.time()
        result = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
        ended = time.time()
    if result.returncode != 0:  # the work directory goes with the exit: its log's end, then the error line
        print((shape_dir / "launches.log").read_text()[-6000:], file=sys.stderr)
        sys.exit(f"error: the launch of {ranks} ranks on {servers} servers exited with {result.returncode}")
    return started, ended - started, launchers.most_mb


class LauncherMemory:
    """The most private memory that the job's per-server DeepSpeed launchers (deepspeed.launcher.launch, one per
    server, which import torch and DeepSpeed too) held together, sampled every 2 s while the launch runs."""

    def __init__(self, master_port: int):
        self.marker, self.most_mb = f"--master_port={master_port}".encode(), 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def __enter__(self) -> "LauncherMemory":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def sample(self) -> None:
        while not self.done.wait(2.0):
            total = 0.0
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    argv = cmdline.read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"deepspeed.launcher.launch" in argv and self.marker in argv:
                    size = private_memory_mb(cmdline.parent.name)
                    total += 0.0 if math.isnan(size) else size
            self.most_mb = max(self.most_mb, total)


def records_since(dllogger_json: Path, started: float) -> list:
    records = []
    for line in dllogger_json.read_text().splitlines():
        if line.startswith("DLLL "):
            record = json.loads(line[5:])
            if float(record["timestamp"]) >= started:
                records.append(record)
    return records


def launch_figures(records: list, started: float) -> dict:
    """One launch's figures from its dllogger records: stage ends (seconds after the launch), CPU seconds per
    rank (training: per step, its last save included), the logged step times, checkpoint times and memory."""
    steps = [r for r in records if r.get("type") == "LOG" and isinstance(r["step"], list) and r["step"]
             and "step_loss" in r["data"]]
    [costs] = [r["data"] for r in records if r.get("step") == "RANK_COSTS"]
    ends = [costs["process_start_unix_first"], costs["imports_done_unix_last"], costs["rendezvous_done_unix_last"],
            costs["engine_ready_unix_last"], float(steps[0]["timestamp"])]
    stages = dict(zip(STAGES, (b - a for a, b in zip([started, *ends], ends))))
    cpu = {"imports": costs["imports_done_cpu_s_mean"],
           "rendezvous": costs["rendezvous_done_cpu_s_mean"] - costs["imports_done_cpu_s_mean"],
           "engine": costs["engine_ready_cpu_s_mean"] - costs["rendezvous_done_cpu_s_mean"],
           "step": (costs["training_done_cpu_s_mean"] - costs["engine_ready_cpu_s_mean"]) / len(steps)}
    return {"to_first_step_s": ends[-1] - started, "stages_s": stages, "cpu_s_per_rank": cpu,
            "step_s": [s["data"]["average_training_time_step"] for s in steps],
            "save_s": costs["checkpoint_save_s_slowest"], "load_s": costs["checkpoint_load_s_slowest"],
            "private_mb_max": costs["private_mb_max"], "peak_resident_mb_max": costs["peak_resident_mb_max"],
            "private_mb_at": {m: costs[f"{m}_private_mb_mean"] for m in MEMORY_MILESTONES}}


def available_mb() -> float:
    """MemAvailable of /proc/meminfo (MiB): what the machine can give without swapping."""
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def wait_for_memory(needed_mb: float) -> None:
    """On a shared machine: a shape starts only once its ranks fit beside what else runs."""
    if available_mb() < needed_mb:
        print(f"waiting for {needed_mb / 1024:.1f} GiB of available memory ({available_mb() / 1024:.1f} now)",
              flush=True)
        while available_mb() < needed_mb:
            time.sleep(10)


def measure(hosts, inputs: dict, work: Path, ranks: int, servers: int, steps: int) -> dict:
    """The shape's two launches (train and save; resume, one step, save): its figures."""
    shape_dir = work / f"{ranks}x{servers}"
    shape_dir.mkdir(parents=True)
    dllogger_json = shape_dir / "results" / "dllogger.json"
    first_started, first_wall, first_launchers = launch(hosts, inputs, shape_dir, ranks, servers, steps,
                                                         HL_RUN_STEPS=str(steps))
    first = launch_figures(records_since(dllogger_json, first_started), first_started)
    second_started, second_wall, second_launchers = launch(hosts, inputs, shape_dir, ranks, servers, steps)
    second = launch_figures(records_since(dllogger_json, second_started), second_started)
    shutil.rmtree(shape_dir / "results" / "checkpoints")  # some 100 MB per shape
    return {"ranks": ranks, "servers": servers, "to_first_step_s": first["to_first_step_s"],
            "stages_s": first["stages_s"], "cpu_s_per_rank": first["cpu_s_per_rank"],
            "private_mb_at": first["private_mb_at"],
            "resume_to_first_step_s": second["to_first_step_s"], "step_s": statistics.median(first["step_s"][1:]),
            "save_s": statistics.mean(first["save_s"] + second["save_s"]), "load_s": second["load_s"][0],
            "private_mb_max": max(first["private_mb_max"], second["private_mb_max"]),
            "peak_resident_mb_max": max(first["peak_resident_mb_max"], second["peak_resident_mb_max"]),
            "launchers_mb_per_server": max(first_launchers, second_launchers) / servers,
            "launch_wall_s": [first_wall, second_wall]}


COLUMNS = [("to first step", "to_first_step_s", "{:.1f}"), ("resumed", "resume_to_first_step_s", "{:.1f}"),
           ("step", "step_s", "{:.3f}"), ("save", "save_s", "{:.2f}"), ("load", "load_s", "{:.2f}"),
           ("private MB", "private_mb_max", "{:.0f}"), ("peak RSS MB", "peak_resident_mb_max", "{:.0f}"),
           ("launcher MB per server", "launchers_mb_per_server", "{:.0f}")]


def report(rows: list) -> None:
    base = rows[0]
    print(f"\nseconds, and the ratio to {base['ranks']} rank(s) on {base['servers']} server(s) in brackets")
    print("| ranks | servers | " + " | ".join(name for name, _, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for row in rows:
        cells = [f"{fmt.format(row[key])} ({row[key] / base[key]:.1f}x)" for _, key, fmt in COLUMNS]
        print(f"| {row['ranks']} | {row['servers']} | " + " | ".join(cells) + " |")
    print("\nlaunch -> first step by stage (wall s, the slowest rank's), and CPU s per rank (mean)")
    print("| ranks | servers | " + " | ".join(STAGES) + " | CPU: imports | rendezvous | engine | a step |")
    print("|---|---|" + "---|" * (len(STAGES) + 4))
    for row in rows:
        stages = " | ".join(f"{row['stages_s'][stage]:.1f}" for stage in STAGES)
        cpu = " | ".join(f"{row['cpu_s_per_rank'][part]:.2f}" for part in ("imports", "rendezvous", "engine", "step"))
        print(f"| {row['ranks']} | {row['servers']} | {stages} | {cpu} |")
    print("\nprivate memory per rank (MB, mean) after: " + ", ".join(MEMORY_MILESTONES) + " (the first launch)")
    for row in rows:
        print(f"| {row['ranks']} | {row['servers']} | "
              + " | ".join(f"{row['private_mb_at'][m]:.0f}" for m in MEMORY_MILESTONES) + " |")


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    panels = [("launch -> first step (s)", ["to_first_step_s", "resume_to_first_step_s"]),
              ("step time (s)", ["step_s"]), ("checkpoint save and load (s)", ["save_s", "load_s"]),
              ("memory per rank, largest (MB)", ["private_mb_max", "peak_resident_mb_max"])]
    rank_counts = sorted({row["ranks"] for row in rows})
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (title, keys) in zip(axes.flat, panels):
        for colour, servers in enumerate(sorted({row["servers"] for row in rows})):
            shape = [row for row in rows if row["servers"] == servers]
            for key, style in zip(keys, ("o-", "s--")):
                axis.plot([row["ranks"] for row in shape], [row[key] for row in shape], style, color=f"C{colour}",
                          label=f"{key.removesuffix('_s').replace('_', ' ')}, {servers} server(s)")
        axis.set_title(title)
        axis.set_xlabel("ranks")
        axis.set_xscale("log", base=2)
        axis.set_xticks(rank_counts, [str(ranks) for ranks in rank_counts])
        axis.legend(fontsize=7)
        axis.grid(True, alpha=0.3)
    figure.suptitle("Cost against ranks and servers: the tiny model, 2-core CPU (shared), namespace servers")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=5, help="Steps of the first launch (its step 1 is not timed).")
    parser.add_argument("--plot", type=Path, help="Where to write the plot (PNG).")
    parser.add_argument("--json", type=Path, help="Where to write the figures.")
    parser.add_argument("--memory_per_rank_mb", type=float, default=420,
                        help="A shape starts once the machine has this much available memory per rank, 250 MB per "
                             "server (its DeepSpeed launcher) and 1 GiB more (a rank of the tiny model that gives "
                             "freed memory back peaks near 350 MB private).")
    args = parser.parse_args()
    shapes = [(ranks, servers) for ranks in sorted(args.ranks) for servers in sorted(args.servers)
              if ranks % servers == 0]
    if not shapes or args.steps < 2:
        parser.error("no shape: give rank counts that are multiples of some server count, and --steps of 2 or more")
    multihost = load_test_hosts()
    reason = multihost.unavailable_reason()
    if reason:
        sys.exit(f"error: {reason}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        work = Path(tmp)
        inputs = write_inputs(work, max(ranks for ranks, _ in shapes) * (args.steps + 1) + 7)
        with multihost.TestHosts(work / "hosts", count=max(servers for _, servers in shapes), tag="b") as hosts:
            # Not reported: the first launch reads the environment's libraries from disk, the others from memory.
            measure(hosts, inputs, work / "warm-up", 1, 1, 2)
            for ranks, servers in shapes:
                wait_for_memory(ranks * args.memory_per_rank_mb + servers * 250 + 1024)
                rows.append(measure(hosts, inputs, work, ranks, servers, args.steps))
                print(f"{ranks} rank(s) on {servers} server(s): {json.dumps(rows[-1])}", flush=True)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
