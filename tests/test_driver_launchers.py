"""scripts/run_bert_*.sh: the reference's arguments and launcher form, HL_* overrides, early failures,
SIGTERM forwarding.

A stub `deepspeed` first on PATH records the command line instead of launching anything; with
STUB_TREE set it imitates DeepSpeed's process tree instead (see STUB_TREE_SCRIPT).
"""

import os
import re
import shlex
import signal
import subprocess
import time

import pytest

import helpers
from training.run_status import ExitStatus

SCRIPTS = helpers.REPO_ROOT / "scripts"


@pytest.fixture
def stub_launcher(tmp_path):
    """A `deepspeed` executable that writes its arguments, one per line, to tmp_path/args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "deepspeed"
    stub.write_text(f'#!/usr/bin/env bash\nlog={shlex.quote(str(tmp_path))}\n'
                    f'[[ -n "${{STUB_ROLE:-}}" ]] || printf "%s\\n" "$@" > "$log/args"\n{STUB_TREE_SCRIPT}')
    stub.chmod(0o755)
    # Several nodes: the launcher signals the ranks over pdsh; this one finds none on any host.
    pdsh = bin_dir / "pdsh"
    pdsh.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {shlex.quote(str(tmp_path))}/pdsh_args\necho 0\n')
    pdsh.chmod(0o755)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    env = dict(helpers.environ_without_rank(),
               PATH=os.pathsep.join([str(bin_dir), str(helpers.VENV_BIN), os.environ["PATH"]]),
               HL_DATA_DIR=str(data_dir), HL_RESULTS_DIR=str(tmp_path / "results"), HL_PREFLIGHT="0",
               # the launchers check that HL_DEVICE's devices exist: the stand-in bridge reports
               # STUB_HPU_COUNT (8) Gaudis
               PYTHONPATH=os.pathsep.join([str(helpers.FAKE_HABANA), os.environ.get("PYTHONPATH", "")]))
    return env, tmp_path


# The process tree of the `deepspeed` runner, by STUB_TREE (unset: exit at once). Each process notes
# the signals it receives in $log/<role>_signalled; `started` appears once every handler is in place.
#   starting: the runner before it has started any child (sleeps; dies of SIGTERM, as DeepSpeed's does)
#   ranks:    runner (no handler) -> launch -> rank, which exits 0 on SIGTERM (saves, in the real driver)
#   launching: runner (no handler) -> launch, before launch has started any rank (sleeps)
#   pdsh:     runner -> pdsh -> ssh; the runner's SIGTERM handler stops pdsh and ssh with SIGKILL and
#             exits 1 (as runner.py's handler stops pdsh and exits 1), after a pause in which an ssh
#             signalled too would have noted it
STUB_TREE_SCRIPT = r"""
note() { touch "$log/$1_signalled"; }
case "${STUB_ROLE:-runner}/${STUB_TREE:-}" in
    runner/) exit 0 ;;
    runner/starting) touch "$log/started"; exec sleep 300 ;;
    runner/ranks) STUB_ROLE=launch "$0" & wait $! ;;
    runner/launching) STUB_ROLE=launch "$0" & wait $! ;;
    launch/launching) touch "$log/started"; exec sleep 300 ;;
    launch/ranks) trap 'note launch' TERM; STUB_ROLE=rank "$0" & wait $!; wait $! ;;
    rank/ranks) trap 'note rank; kill $child; exit 0' TERM; touch "$log/started"; sleep 300 & child=$!; wait $child ;;
    runner/pdsh) trap 'note runner; sleep 0.5; pkill -KILL -P $child; kill -KILL $child; exit 1' TERM
                 STUB_ROLE=pdsh "$0" & child=$!; wait $child ;;
    pdsh/pdsh) STUB_ROLE=ssh "$0" & wait $! ;;
    ssh/pdsh) trap 'note ssh' TERM; touch "$log/started"; while :; do sleep 0.1 & wait $!; done ;;
esac
"""


def sigterm_once_started(script, env, tmp_path, tree) -> int:
    """Start `script` with the stub tree `tree`, SIGTERM the script alone once the tree is up; its status."""
    process = subprocess.Popen(["bash", str(SCRIPTS / script)], env=dict(env, STUB_TREE=tree),
                               stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(600):  # hang guard only
            if (tmp_path / "started").exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "started").exists() and process.poll() is None
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=60)
    finally:
        helpers.kill_job(process)  # whatever the stub tree left behind


def test_sigterm_before_the_ranks_exist_stops_the_runner(stub_launcher):
    # Formerly the signal was swallowed here (no rank to pass it to) and only SIGKILL ended the job.
    env, tmp_path = stub_launcher
    assert sigterm_once_started("run_bert_1.5b_8x.sh", env, tmp_path, "starting") == 128 + signal.SIGTERM


def test_sigterm_on_one_node_goes_to_the_ranks_only(stub_launcher):
    env, tmp_path = stub_launcher
    assert sigterm_once_started("run_bert_1.5b_8x.sh", env, tmp_path, "ranks") == 0
    assert (tmp_path / "rank_signalled").exists() and not (tmp_path / "launch_signalled").exists()


def test_sigterm_while_the_launch_starts_its_ranks_stops_the_runner(stub_launcher):
    # Formerly pgrep's status 1 (the launch has no child yet) ended the handler under set -e: the script
    # exited 1 and left the runner and the launch running.
    env, tmp_path = stub_launcher
    assert sigterm_once_started("run_bert_1.5b_8x.sh", env, tmp_path, "launching") == 128 + signal.SIGTERM


def test_sigterm_on_several_nodes_without_ranks_yet_goes_to_the_runner_only(stub_launcher):
    """The launcher first asks every host over pdsh to signal the job's ranks (the stub pdsh finds none, as
    during start-up), then signals the runner alone. The ranks' side: test_multihost.py, on real hosts."""
    env, tmp_path = stub_launcher
    assert sigterm_once_started("run_bert_1.5b_32x.sh", env, tmp_path, "pdsh") == 1
    assert (tmp_path / "runner_signalled").exists() and not (tmp_path / "ssh_signalled").exists()
    pdsh_args = (tmp_path / "pdsh_args").read_text().splitlines()
    assert pdsh_args[pdsh_args.index("-w") + 1] == "10.10.100.101,10.10.100.102,10.10.100.103,10.10.100.104"
    assert pdsh_args[-4:] == [str(SCRIPTS / "signal_ranks.sh"), "10.10.100.101", "29500", "TERM"]


# For helpers.run_launch_ranks: a rank that stops as the driver does on SIGTERM or SIGINT (it would save a
# checkpoint, then exit STOPPED), after a line that names the signal; each line one write(2), whole in the pipe.
STOPPING_RANK = f"""
import os, signal, sys, time
def stop(signum, frame):
    os.write(1, f"rank {{os.environ['RANK']}} stops on {{signal.Signals(signum).name}}\\n".encode())
    sys.exit({int(ExitStatus.STOPPED)})
for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, stop)
os.write(1, b"rank up\\n")
time.sleep(300)
"""


def test_ctrl_c_at_a_terminal_stops_the_ranks_as_sigint_to_the_launcher_alone_does(tmp_path):
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group: the launcher, and, before the runner
    had a session of its own, the deepspeed runner, its per-node launcher and the ranks. Now the launcher alone
    gets it and passes one SIGTERM to each rank, which stops cleanly; the launcher exits STOPPED, the ranks' status.
    Formerly the per-node launcher (deepspeed.launcher.launch) terminated the ranks itself and exited 1."""
    status, lines, alive = helpers.run_launch_ranks(STOPPING_RANK, tmp_path,
                                                    lambda process: os.killpg(process.pid, signal.SIGINT))
    assert status == ExitStatus.STOPPED, lines
    assert sorted(line for line in lines if line.startswith("rank ") and " stops on " in line) == [
        "rank 0 stops on SIGTERM", "rank 1 stops on SIGTERM"], lines
    assert alive == []


def test_a_hangup_ends_the_runner_and_the_ranks(tmp_path):
    """The terminal closed: SIGHUP to the launcher's process group, which the ranks' session does not share. The
    launcher passes it on to that session, so that the runner and the ranks end, as they did when the terminal's
    hangup reached them directly."""
    status, lines, alive = helpers.run_launch_ranks(STOPPING_RANK, tmp_path,
                                                    lambda process: os.killpg(process.pid, signal.SIGHUP))
    assert status == 128 + signal.SIGHUP, lines
    assert alive == [], lines


def launch(script, env):
    return subprocess.run(["bash", str(SCRIPTS / script)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script,nodes,max_steps,per_cp,log_freq,config,ds_config,extra", [
    ("run_bert_1.5b_8x.sh", "1", "155000", "200", "10", "bert_1.5b_config.json", "deepspeed_config_bert_1.5b.json",
     []),
    ("run_bert_1.5b_32x.sh", "4", "155000", "200", "10", "bert_1.5b_config.json", "deepspeed_config_bert_1.5b.json",
     []),
    ("run_bert_5b_128x.sh", "16", "75000", "120", "1", "bert_5b_config.json", "deepspeed_config_bert_5b.json",
     ["--checkpoint_activations"]),
])
def test_launchers_pass_the_reference_arguments(stub_launcher, script, nodes, max_steps, per_cp, log_freq, config,
                                                ds_config, extra):
    env, tmp_path = stub_launcher
    hosts = [f"10.0.0.{i + 1}" for i in range(int(nodes))]
    (tmp_path / "hostfile").write_text("".join(f"{host} slots=8\n" for host in hosts))
    result = launch(script, dict(env, HL_HOSTSFILE=str(tmp_path / "hostfile")))
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    python_at = args.index(str(helpers.VENV_BIN / "python"))  # absolute: ssh's PATH on another server differs
    launcher, program = args[:args.index("env")], args[python_at:]  # env: the ranks' HPU settings (test_gaudi_lazy)
    if nodes != "1":  # several servers, under training/supervisor.py: the job's hosts, the first as master
        assert launcher[:2] == ["--num_nodes", nodes]
        assert launcher[-4:] == ["--num_gpus", "8", "--no_local_rank", "--no_python"]
        assert launcher[2] == "--hostfile" and launcher[4:8] == ["--master_addr", hosts[0], "--master_port", "29500"]
        assert launcher[8] == "--log_level=warning"  # no INFO lines, on every device (launch_common.sh)
        assert "supervisor: restart" not in result.stdout
        assert result.stdout.splitlines()[0].startswith("deepspeed --num_nodes")
    else:
        assert launcher == ["--log_level=warning", "--num_nodes", "1", "--num_gpus", "8", "--no_local_rank",
                            "--no_python", "--master_port", "29500"]
    assert program[1:3] == ["-u", "./run_pretraining.py"]
    for expected in ("--use_hpu", "--optimizer=lans", "--use_lr_scheduler", "--resume_from_checkpoint",
                     "--seed=12439", "--max_predictions_per_seq=20",
                     "--learning_rate=0.0015", "--warmup_proportion=0.05", "--constant_proportion=0.25",
                     "--scheduler_degree=1.0", f"--max_steps={max_steps}", "--steps_this_run=-1",
                     f"--num_steps_per_checkpoint={per_cp}", f"--log_freq={log_freq}",
                     f"--config_file={SCRIPTS / config}", f"--deepspeed_config={SCRIPTS / ds_config}", *extra):
        assert expected in program, expected


def test_phase2_launcher_resumes_phase1_checkpoints_with_phase2_data_and_schedule(stub_launcher):
    env, tmp_path = stub_launcher
    checkpoints = tmp_path / "results" / "checkpoints"
    result = launch("run_bert_1.5b_8x_phase2.sh", env)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"error: phase 2 starts from phase 1's last checkpoint, and {checkpoints} has none (set HL_CHECKPOINTS_DIR or "
        "HL_RESULTS_DIR to phase 1's)")
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text("155000")
    env.pop("HL_DATA_DIR")
    env["HL_DATA_DIR_ROOT"] = str(tmp_path / "root")
    phase2_data = (tmp_path / "root" / "hdf5_lower_case_1_seq_len_512_max_pred_80_masked_lm_prob_0.15_random_seed_12345"
                   "_dupe_factor_5" / "books_wiki_en_corpus")
    phase2_data.mkdir(parents=True)
    result = launch("run_bert_1.5b_8x_phase2.sh", env)
    assert result.returncode == 0, result.stderr
    program = (tmp_path / "args").read_text().splitlines()
    for expected in ("--phase2", "--phase1_end_step=155000", "--resume_from_checkpoint", f"--input_dir={phase2_data}",
                     f"--output_dir={checkpoints}", "--max_predictions_per_seq=80", "--learning_rate=0.001",
                     "--warmup_proportion=0.128", "--constant_proportion=0", "--max_steps=51667",
                     f"--json-summary={tmp_path / 'results' / 'dllogger_phase2.json'}",
                     f"--deepspeed_config={SCRIPTS / 'deepspeed_config_bert_1.5b_phase2.json'}"):
        assert expected in program, expected
    assert "--max_predictions_per_seq=20" not in program
    env["HL_PHASE1_END_STEP"] = "7038"
    assert launch("run_bert_1.5b_8x_phase2.sh", env).returncode == 0
    assert "--phase1_end_step=7038" in (tmp_path / "args").read_text().splitlines()


def test_phase_in_the_environment_does_not_turn_a_phase1_launcher_into_phase2(stub_launcher):
    env, tmp_path = stub_launcher
    assert launch("run_bert_1.5b_8x.sh", dict(env, PHASE="2")).returncode == 0
    program = (tmp_path / "args").read_text().splitlines()
    assert "--phase2" not in program and "--max_predictions_per_seq=20" in program


def test_hl_overrides_reach_the_command(stub_launcher):
    env, tmp_path = stub_launcher
    env.update(HL_NUM_NODES="1", HL_NGPU_PER_NODE="2", HL_DEVICE="cpu", HL_MAX_STEPS="7", HL_RUN_STEPS="3",
               HL_CHECKPOINTS_DIR=str(tmp_path / "ckpt"))
    assert launch("run_bert_1.5b_32x.sh", env).returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:7] == ["--log_level=warning", "--num_nodes", "1", "--num_gpus", "2", "--no_local_rank", "--no_python"]
    for expected in ("--no_cuda", "--max_steps=7", "--steps_this_run=3", f"--output_dir={tmp_path / 'ckpt'}"):
        assert expected in args
    assert "--use_hpu" not in args


def test_relative_hl_paths_are_taken_from_the_callers_directory(stub_launcher):
    """The launcher checks the paths where it is started and the ranks run in the repository's root: a
    relative HL_* path reaches the command line made absolute against the caller's directory."""
    env, tmp_path = stub_launcher
    caller = tmp_path / "caller"
    (caller / "shards").mkdir(parents=True)
    (caller / "model.json").write_text((SCRIPTS / "bert_1.5b_config.json").read_text())
    (caller / "ds.json").write_text((SCRIPTS / "deepspeed_config_bert_1.5b.json").read_text())
    env.update(HL_DATA_DIR="shards", HL_MODEL_CONFIG="./model.json", HL_DS_CONFIG="ds.json", HL_RESULTS_DIR="res")
    result = subprocess.run(["bash", str(SCRIPTS / "run_bert_1.5b_8x.sh")], env=env, cwd=caller, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    for expected in (f"--input_dir={caller / 'shards'}", f"--config_file={caller / 'model.json'}",
                     f"--deepspeed_config={caller / 'ds.json'}", f"--output_dir={caller / 'res' / 'checkpoints'}",
                     f"--json-summary={caller / 'res' / 'dllogger.json'}"):
        assert expected in args, expected


def test_squad_launcher_takes_relative_paths_from_the_callers_directory(stub_launcher):
    env, tmp_path = stub_launcher
    caller = tmp_path / "caller"
    (caller / "squad").mkdir(parents=True)
    for split in ("train", "dev"):
        (caller / "squad" / f"{split}-v1.1.json").write_text('{"version": "1.1", "data": []}')
    (caller / "weights").mkdir()
    (caller / "vocab.txt").write_text("[PAD]\n")
    env.update(HL_DEVICE="cpu", INIT_CHECKPOINT="weights", SQUAD_DIR="squad", VOCAB_FILE="vocab.txt",
               HL_RESULTS_DIR="res")
    result = subprocess.run(["bash", str(SCRIPTS / "run_squad.sh")], env=env, cwd=caller, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    for flag, value in (("--init_checkpoint", caller / "weights"), ("--vocab_file", caller / "vocab.txt"),
                        ("--train_file", caller / "squad" / "train-v1.1.json"), ("--output_dir", caller / "res")):
        assert args[args.index(flag) + 1] == str(value), flag


def test_missing_data_dir_fails_early_with_a_clear_message(stub_launcher):
    env, tmp_path = stub_launcher
    env["HL_DATA_DIR"] = str(tmp_path / "nowhere")
    result = launch("run_bert_1.5b_8x.sh", env)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: data directory {tmp_path / 'nowhere'} does not exist (set "
                                     "HL_DATA_DIR_ROOT or HL_DATA_DIR; "
                                     "build it with data/create_datasets_from_start.sh)")
    assert not (tmp_path / "args").exists()


@pytest.mark.parametrize("nodes", ["0", "abc", "01", "-2", ""])
def test_a_number_of_servers_that_is_not_a_positive_number_is_one_clear_error(stub_launcher, nodes):
    env, tmp_path = stub_launcher
    (tmp_path / "hostfile").write_text("10.0.0.1 slots=8\n10.0.0.2 slots=8\n")
    result = launch("run_bert_1.5b_8x.sh", dict(env, HL_NUM_NODES=nodes, HL_HOSTSFILE=str(tmp_path / "hostfile")))
    if nodes == "":  # unset: the launcher's own count
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1
    assert result.stderr == f"error: HL_NUM_NODES must be a number of servers (1 or more), not '{nodes}'\n"
    assert not (tmp_path / "args").exists()


def test_several_nodes_without_hostfile_fail_early(stub_launcher):
    env, tmp_path = stub_launcher
    env["HL_HOSTSFILE"] = str(tmp_path / "no_hostsfile")
    result = launch("run_bert_5b_128x.sh", env)
    assert result.returncode == 1 and "need a hostfile" in result.stderr


@pytest.mark.parametrize("name,world,gas,stage", [("deepspeed_config_bert_1.5b.json", 8, 48, 1),
                                                  ("deepspeed_config_bert_1.5b.json", 32, 12, 1),
                                                  ("deepspeed_config_bert_1.5b_phase2.json", 8, 64, 1),
                                                  ("deepspeed_config_bert_5b.json", 128, 4, 2)])
def test_reference_deepspeed_configs_are_accepted_by_stock_deepspeed(tmp_path, name, world, gas, stage):
    import json

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from training import pretraining_config
    config = json.loads((SCRIPTS / name).read_text())
    config["tensorboard"]["enabled"] = False  # the tensorboard package is not a test dependency
    (tmp_path / name).write_text(json.dumps(config))
    config = pretraining_config.deepspeed_config_with_optimizer(str(tmp_path / name), world, "lans")
    assert config["gradient_accumulation_steps"] == gas  # 12288 = micro x GAS x world, as the reference
    assert DeepSpeedZeroConfig(**config["zero_optimization"]).stage == stage  # no fork-only keys
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 1.0


def ignored_flags() -> set:
    """The flags run_pretraining.py accepts for compatibility only (its 'ignored' argument group)."""
    from run_pretraining import build_parser
    (group,) = [g for g in build_parser()._action_groups if g.title == "ignored"]
    return {option for action in group._group_actions for option in action.option_strings}


def test_launchers_pass_no_flag_that_does_nothing():
    assert {"--do_train", "--bert_model", "--max_seq_length"} <= ignored_flags()
    # The fine-tuning launchers pass flags of their own scripts (run_glue.py's --do_train is real).
    scripts = [script for script in sorted((helpers.REPO_ROOT / "scripts").glob("*.sh"))
               if not re.search(r"run_(glue|squad)\.py", script.read_text())]
    passed = {f"{script.name}: {flag}" for script in scripts for flag in ignored_flags()
              if re.search(rf"{re.escape(flag)}(?![\w-])", script.read_text())}
    assert not passed, passed


def test_launchers_run_the_preflight_before_anything_starts(stub_launcher):
    env, tmp_path = stub_launcher
    (tmp_path / "hostfile").write_text("10.0.0.1 slots=8\n10.0.0.1 slots=8\n")
    env.pop("HL_PREFLIGHT")
    env.update(HL_HOSTSFILE=str(tmp_path / "hostfile"), HL_NUM_NODES="2")
    result = launch("run_bert_1.5b_32x.sh", env)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: preflight: hostfile {tmp_path / 'hostfile'} line 2: host 10.0.0.1 is "
                                     "listed twice (first on line 1)")
    assert not (tmp_path / "args").exists()


def ready_to_launch(script, env, tmp_path) -> dict:
    """`env` with what `script` needs besides the device (the fine-tuning launchers' checkpoint and data)."""
    if script == "run_squad.sh":
        squad_dir = tmp_path / "squad"
        squad_dir.mkdir(exist_ok=True)
        for split in ("train", "dev"):
            (squad_dir / f"{split}-v1.1.json").write_text('{"version": "1.1", "data": []}')
        return dict(env, INIT_CHECKPOINT=str(tmp_path), SQUAD_DIR=str(squad_dir))
    if script == "run_glue.sh":
        return dict(env, INIT_CHECKPOINT=str(tmp_path), DATA_DIR=str(tmp_path))
    return env


DEVICE_CHECKED = ["run_bert_1.5b_8x.sh", "run_squad.sh", "run_glue.sh"]


@pytest.mark.parametrize("script", DEVICE_CHECKED)
@pytest.mark.parametrize("device_env,message", [
    ({}, "error: HL_DEVICE=hpu (the default) but this machine has no Gaudi device: set HL_DEVICE=cpu (or cuda, hpu) "
         "and HL_NGPU_PER_NODE to the number of ranks"),
    ({"HL_DEVICE": "cuda"}, "error: HL_DEVICE=cuda but this machine has no CUDA device: set HL_DEVICE=cpu (or cuda, "
                            "hpu) and HL_NGPU_PER_NODE to the number of ranks"),
    ({"STUB_HPU_COUNT": "4"}, "error: HL_NGPU_PER_NODE=8 but this machine has 4 Gaudi devices: set HL_NGPU_PER_NODE=4 "
                              "or fewer"),
    ({"HL_DEVICE": "cpu", "HL_NGPU_PER_NODE": "0"}, "error: HL_NGPU_PER_NODE must be a number of devices (1 or more), "
                                                    "not '0'"),
])
def test_a_device_this_machine_lacks_stops_the_launcher_before_any_rank(stub_launcher, script, device_env, message):
    """Formerly run_squad.sh started 8 ranks on a machine without Gaudi: 443 lines with 16 tracebacks."""
    env, tmp_path = stub_launcher
    env = ready_to_launch(script, dict(env, **device_env), tmp_path)
    if not device_env:  # no Gaudi, as on this machine
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    result = launch(script, env)
    assert (result.returncode, result.stderr, result.stdout) == (1, message + "\n", "")
    assert not (tmp_path / "args").exists()


@pytest.mark.parametrize("script", DEVICE_CHECKED)
def test_the_devices_this_machine_has_are_launched(stub_launcher, script):
    env, tmp_path = stub_launcher
    for device_env, flag in (({"STUB_HPU_COUNT": "8"}, "--use_hpu"), ({"HL_DEVICE": "cpu"}, "--no_cuda")):
        assert launch(script, ready_to_launch(script, dict(env, **device_env), tmp_path)).returncode == 0
        args = (tmp_path / "args").read_text().splitlines()
        assert args[args.index("--num_gpus") + 1] == "8" and flag in args


def test_glue_launcher_command_line(stub_launcher):
    env, tmp_path = stub_launcher
    env = ready_to_launch("run_glue.sh", dict(env, HL_DEVICE="cpu", HL_NGPU_PER_NODE="2", TASK_NAME="mrpc"), tmp_path)
    result = launch("run_glue.sh", env)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:11] == ["--log_level=warning", "--num_nodes", "1", "--num_gpus", "2", "--no_local_rank", "--no_python",
                         "--master_port", "29500", str(helpers.VENV_BIN / "python"), "-u"]
    program = args[11:]
    assert program[:2] == ["./run_glue.py", "--no_cuda"]
    for flag, value in (("--task_name", "mrpc"), ("--data_dir", str(tmp_path)), ("--init_checkpoint", str(tmp_path)),
                        ("--output_dir", str(tmp_path / "results"))):
        assert program[program.index(flag) + 1] == value
    assert "--deepspeed" not in program  # no HL_DS_CONFIG: run_glue.py's fp32 ZeRO-0
    from run_glue import build_parser
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert {arg for arg in program if arg.startswith("--")} <= known


def test_glue_launcher_takes_its_earlier_variable_names(stub_launcher):
    env, tmp_path = stub_launcher
    (tmp_path / "ds.json").write_text("{}")
    env.pop("HL_RESULTS_DIR")
    env = ready_to_launch("run_glue.sh", dict(env, DEVICE="cpu", NUM_DEVICES="3", OUTPUT_DIR=str(tmp_path / "out"),
                                              DEEPSPEED_CONFIG=str(tmp_path / "ds.json"), MASTER_PORT="29555"),
                          tmp_path)
    assert launch("run_glue.sh", env).returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    for flag, value in (("--num_gpus", "3"), ("--master_port", "29555"), ("--output_dir", str(tmp_path / "out")),
                        ("--deepspeed_config", str(tmp_path / "ds.json"))):
        assert args[args.index(flag) + 1] == value
    assert "--no_cuda" in args


def test_glue_launcher_runs_on_several_servers_and_forwards_sigterm_to_the_ranks(stub_launcher):
    env, tmp_path = stub_launcher
    env = ready_to_launch("run_glue.sh", dict(env, HL_DEVICE="cpu"), tmp_path)
    assert launch("run_glue.sh", dict(env, HL_NUM_NODES="2")).returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args[7:12] == [f"--hostfile={SCRIPTS / 'hostsfile'}", "--master_addr", "10.10.100.101", "--master_port",
                          "29500"]
    assert sigterm_once_started("run_glue.sh", env, tmp_path, "ranks") == 0
    assert (tmp_path / "rank_signalled").exists() and not (tmp_path / "launch_signalled").exists()


@pytest.mark.parametrize("script", ["run_glue.sh", "run_squad.sh"])
def test_fine_tuning_launchers_resume_and_refuse_checkpoints_of_other_weights(stub_launcher, script):
    """One behaviour for every launcher: resume when the results directory holds checkpoints. Formerly a
    re-run of run_glue.sh stopped in every rank with '... holds checkpoints: pass --resume_from_checkpoint',
    buried among the DeepSpeed launcher's lines."""
    env, tmp_path = stub_launcher
    env = ready_to_launch(script, dict(env, HL_DEVICE="cpu"), tmp_path)
    first = launch(script, env)
    assert first.returncode == 0 and "== resuming" not in first.stdout
    assert "--resume_from_checkpoint" in (tmp_path / "args").read_text().splitlines()  # none yet: starts afresh
    (tmp_path / "results" / "checkpoints" / "12").mkdir(parents=True)  # as a stopped run leaves them
    again = launch(script, env)
    assert again.returncode == 0
    assert f"== resuming from {tmp_path / 'results' / 'checkpoints'}" in again.stdout.splitlines()[0]
    (tmp_path / "args").unlink()
    other = tmp_path / "other_weights"
    other.mkdir()
    refused = launch(script, dict(env, INIT_CHECKPOINT=str(other)))
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == (f"error: {tmp_path / 'results' / 'checkpoints'} holds a fine-tuning of {tmp_path}, "
                              f"not of INIT_CHECKPOINT {other}: set HL_RESULTS_DIR to a new directory "
                              "(or remove that one)\n")
    assert not (tmp_path / "args").exists()


def resource_args(**environ) -> subprocess.CompletedProcess:
    """launch_common.sh's resource_args (argument building only; no device is looked for) in `environ`."""
    script = 'source scripts/launch_common.sh; resource_args; printf "%s\\n" "${RUNNER_ENV[@]}" "${RESOURCE_ARGS[@]}"'
    return subprocess.run(["bash", "-c", script],
                          cwd=helpers.REPO_ROOT, env=dict(helpers.environ_without_rank(), **environ),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("environ,expected", [
    # DeepSpeed 0.19.8's runner drops CUDA_VISIBLE_DEVICES when --num_gpus is given: the listed devices go in --include
    ({"HL_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "NGPU_PER_NODE": "4"},
     ["env", "-u", "CUDA_VISIBLE_DEVICES", "--include", "localhost:4,5,6,7"]),
    ({"HL_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "6,7,0,1,2", "NGPU_PER_NODE": "3"},
     ["env", "-u", "CUDA_VISIBLE_DEVICES", "--include", "localhost:6,7,0"]),
    ({"HL_DEVICE": "cuda", "NGPU_PER_NODE": "8"}, ["--num_nodes", "1", "--num_gpus", "8"]),
    ({"HL_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "", "NGPU_PER_NODE": "8"}, ["--num_nodes", "1", "--num_gpus", "8"]),
    # several servers: the runner uses the hostfile's slots on every server (devices 0..G-1)
    ({"HL_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "4,5", "NGPU_PER_NODE": "2", "NUM_NODES": "2"},
     ["--num_nodes", "2", "--num_gpus", "2"]),
    # no CUDA: the variable does not choose the devices
    ({"HL_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "4,5", "NGPU_PER_NODE": "2"},
     ["--num_nodes", "1", "--num_gpus", "2"]),
])
def test_one_cuda_server_launches_on_the_devices_cuda_visible_devices_lists(environ, expected):
    result = resource_args(**{"NUM_NODES": "1", **environ})
    assert (result.returncode, result.stdout.splitlines(), result.stderr) == (0, expected, "")


def test_cuda_visible_devices_by_uuid_is_one_error_line():
    result = resource_args(HL_DEVICE="cuda", CUDA_VISIBLE_DEVICES="GPU-5f2a,1", NUM_NODES="1", NGPU_PER_NODE="2")
    assert (result.returncode, result.stdout, result.stderr) == (
        1, "", "error: CUDA_VISIBLE_DEVICES=GPU-5f2a,1: the deepspeed launcher takes devices by index only "
               "(e.g. 4,5,6,7), not 'GPU-5f2a'\n")
