"""The 32x launcher at its own shape: `scripts/run_bert_1.5b_32x.sh`, with only the documented HL_* overrides (a
tiny model on the CPU), across 4 test hosts (tests/multihost.py) of SLOTS ranks each. It trains, saves, and the
same command resumes, under ZeRO-1 and ZeRO-2 with per-tensor LANS; its losses equal one rank's. A checkpoint
written by all the ranks resumes on one host's ranks and on 1 rank; one written by 1 rank resumes on all.

Two sizes: 4 x 2 = 8 ranks in the slow suite (CI's full run), and the 32x launcher's 4 x 8 = 32 ranks under its
own marker, `scale` (bash scripts/run_tests.sh tests/test_scale.py -m scale; about 160 MB of private memory per
rank, and minutes per launch on 2 cores: too slow for CI). At both, the word embedding is cut between 8 or more
ranks and some rank's partition holds no whole tensor (test_the_tiny_model_is_cut_between_many_ranks).

The runs are fp32 with the no-dropout tiny model at LR 0.002, as tests/test_world_size.py's, whose tolerance
they use: every run keeps the global batch of 32 samples (micro-batch 1; the accumulation steps follow the
world size), so the ranks change only the rounding.
"""

import importlib.util
import shutil
import subprocess

import pytest

import helpers
from modeling import BertConfig
from test_driver_multirank import no_dropout_config
from test_multihost import DEEPSPEED_ENV, launcher_env, losses, run_launcher, steps_of_each_run
from test_world_size import FP32_TOLERANCE

pytestmark = pytest.mark.slow

HOSTS, STEPS, SAVE_AT, GLOBAL_BATCH = 4, 6, 3, 32
LAUNCH_TIMEOUT_S = 900


@pytest.fixture(scope="module", params=[2, pytest.param(8, marks=pytest.mark.scale)], ids=lambda s: f"{HOSTS}x{s}")
def job(request, tmp_path_factory, test_hosts):
    """Shards, the no-dropout tiny model, DeepSpeed JSONs (fp32, ZeRO-1 and -2, global batch 32, micro-batch 1),
    the hostfile of 4 hosts x `slots` and a HOME with .deepspeed_env; the runs made so far, by name."""
    slots = request.param
    root = tmp_path_factory.mktemp(f"scale_{HOSTS}x{slots}")
    helpers.write_synthetic_shards(root / "data", [100, 70, 50])
    home = root / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(DEEPSPEED_ENV)
    ds_configs = {stage: helpers.write_ds_config(root / f"ds_zero{stage}.json", stage=stage, bf16=False, micro=1,
                                                 world=GLOBAL_BATCH, clipping=0.0) for stage in (1, 2)}
    return {"root": root, "data": root / "data", "home": home, "slots": slots, "ranks": HOSTS * slots,
            "model_config": no_dropout_config(root / "model.json"), "ds_configs": ds_configs,
            "ds_config": ds_configs[1],
            "hostfile": test_hosts.hostfile(root / "hostfile", hosts=HOSTS, slots=slots), "runs": {}}


def launch(hosts, job, results, stage, nodes, ranks_per_node, **overrides):
    """The 32x launcher for STEPS steps with a checkpoint every SAVE_AT; overrides: more HL_* variables."""
    env = launcher_env(hosts, job, results, nodes=nodes, ranks_per_node=ranks_per_node, HL_MAX_STEPS=str(STEPS),
                       HL_NUM_STEPS_PER_CP=str(SAVE_AT), HL_MODEL_CONFIG=str(job["model_config"]),
                       HL_DS_CONFIG=str(job["ds_configs"][stage]), **overrides)
    return run_launcher(hosts, env, "--learning_rate=0.002", timeout=LAUNCH_TIMEOUT_S)


def one_rank(hosts, job):
    """The uninterrupted 1-rank run (ZeRO-1; checkpoints at SAVE_AT and STEPS), made once: its directory."""
    results = job["root"] / "one_rank"
    if "one_rank" not in job["runs"]:
        launch(hosts, job, results, stage=1, nodes=1, ranks_per_node=1)
        assert sorted(losses(results / "dllogger.json")) == list(range(1, STEPS + 1))
        job["runs"]["one_rank"] = results
    return results


def every_host(hosts, job, stage):
    """All the ranks, ZeRO `stage`: stopped at SAVE_AT (a copy of that directory is kept), then resumed by
    the same command; made once per stage. Returns (the directory, the copy at SAVE_AT)."""
    results, saved = job["root"] / f"zero{stage}", job["root"] / f"zero{stage}_at_{SAVE_AT}"
    if stage not in job["runs"]:
        first = launch(hosts, job, results, stage, nodes=HOSTS, ranks_per_node=job["slots"],
                       HL_RUN_STEPS=str(SAVE_AT))
        assert f"preflight: {HOSTS} hosts answer over ssh" in first.stdout
        assert (results / "checkpoints" / "latest").read_text().strip() == str(SAVE_AT)
        shutil.copytree(results, saved)
        launch(hosts, job, results, stage, nodes=HOSTS, ranks_per_node=job["slots"])
        job["runs"][stage] = results
    return results, saved


def checkpoint_files(directory) -> list:
    return sorted(path.name for path in directory.glob("*_optim_states.pt"))


def test_the_tiny_model_is_cut_between_many_ranks(job):
    """The layout these runs have (training/zero_partitions.planned_layout, checked against DeepSpeed's own by
    tests/test_zero_partitions.py). At 8 ranks: the decayed group's 18 tensors (4,399,616 values) in
    partitions of 549,952; the word embedding (30528 x 128) spans all 8, and 7 hold no whole tensor.
    At 32 ranks: partitions of 137,488; the word embedding spans 29 ranks, and 28 hold no whole tensor."""
    spec = importlib.util.spec_from_file_location("plan_zero_layout",
                                                  helpers.REPO_ROOT / "scripts" / "plan_zero_layout.py")
    planner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner)
    groups = planner.named_groups(BertConfig.from_json_file(job["model_config"]))
    decayed = planner.layout_figures(groups, job["ranks"], element_bytes=4)["groups"][0]
    assert decayed["widest_tensor"] == {"name": "bert.embeddings.word_embeddings.weight",
                                        "ranks": {8: 8, 32: 29}[job["ranks"]]}
    assert decayed["ranks_without_a_whole_tensor"] == {8: 7, 32: 28}[job["ranks"]]


# ZeRO-2 in CI's run; ZeRO-1's checkpoint of every host is made and resumed by the tests below.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.extra), 2])
def test_every_host_trains_saves_resumes_and_equals_one_rank(test_hosts, job, stage):
    """4 hosts x SLOTS ranks through pdsh/ssh: steps 1-3, a checkpoint written by every rank, the same command
    continues to step 6; the losses equal the 1-rank run's."""
    expected = losses(one_rank(test_hosts, job) / "dllogger.json")
    results, saved = every_host(test_hosts, job, stage)
    assert len(checkpoint_files(saved / "checkpoints" / str(SAVE_AT))) == job["ranks"]
    assert steps_of_each_run(results / "dllogger.json") == [[1, 2, 3], [4, 5, 6]]
    got = losses(results / "dllogger.json")
    assert max(abs(got[step] - expected[step]) for step in expected) < FP32_TOLERANCE, (got, expected)


@pytest.mark.parametrize("ranks", [pytest.param("one host", marks=pytest.mark.extra), "1 rank"])
def test_a_checkpoint_of_every_host_resumes_on_fewer_ranks(test_hosts, job, ranks, tmp_path):
    """The ZeRO-1 checkpoint that all the ranks wrote at step 3 resumes on one host's SLOTS ranks, and on 1
    rank: steps 4-6 equal the 1-rank uninterrupted run's."""
    expected = losses(one_rank(test_hosts, job) / "dllogger.json")
    _, saved = every_host(test_hosts, job, stage=1)
    results = tmp_path / "resumed"
    shutil.copytree(saved, results)
    launch(test_hosts, job, results, stage=1, nodes=1, ranks_per_node=job["slots"] if ranks == "one host" else 1)
    runs = steps_of_each_run(results / "dllogger.json")
    assert runs == [[1, 2, 3], [4, 5, 6]]
    got = losses(results / "dllogger.json")
    assert max(abs(got[step] - expected[step]) for step in runs[1]) < FP32_TOLERANCE, (got, expected)


def test_a_checkpoint_of_one_rank_resumes_on_every_host(test_hosts, job, tmp_path):
    """The 1-rank run's checkpoint of step 3 resumes on 4 hosts x SLOTS ranks: steps 4-6 equal its own."""
    uninterrupted = one_rank(test_hosts, job)
    expected = losses(uninterrupted / "dllogger.json")
    results = tmp_path / "resumed"
    (results / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / str(SAVE_AT), results / "checkpoints" / str(SAVE_AT))
    (results / "checkpoints" / "latest").write_text(str(SAVE_AT))
    launch(test_hosts, job, results, stage=1, nodes=HOSTS, ranks_per_node=job["slots"])
    assert steps_of_each_run(results / "dllogger.json") == [[4, 5, 6]]
    got = losses(results / "dllogger.json")
    assert max(abs(got[step] - expected[step]) for step in got) < FP32_TOLERANCE, (got, expected)
    assert len(checkpoint_files(results / "checkpoints" / str(STEPS))) == job["ranks"]


def bad_input_error(hosts, job, results, **overrides) -> str:
    """The 32x launcher across every host with bad input: it stops before any rank starts (no `deepspeed`
    command, no log) with one error line on stderr, returned."""
    env = launcher_env(hosts, job, results, nodes=HOSTS, ranks_per_node=job["slots"], **overrides)
    command = hosts.command_on(0, ["bash", helpers.REPO_ROOT / "scripts" / "run_bert_1.5b_32x.sh"])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result
    assert "deepspeed" not in result.stdout and not (results / "dllogger.json").exists(), result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: preflight: "), result.stderr
    return lines[0]


def test_bad_input_at_scale_is_one_line_before_any_rank_starts(test_hosts, job):
    """A hostfile naming a server twice, a global batch that the ranks do not divide, a server without the data."""
    duplicate = job["root"] / "hostfile_duplicate"
    addresses = test_hosts.addresses[:HOSTS]
    duplicate.write_text("".join(f"{a} slots={job['slots']}\n" for a in [*addresses[:2], addresses[0], addresses[3]]))
    line = bad_input_error(test_hosts, job, job["root"] / "bad_duplicate", HL_HOSTSFILE=str(duplicate))
    assert f"line 3: host {addresses[0]} is listed twice (first on line 1)" in line, line

    batch = job["ranks"] + 4  # 12 or 36: not a multiple of 8 or 32 ranks x micro-batch 1
    ds_config = helpers.write_ds_config(job["root"] / "ds_indivisible.json", stage=1, bf16=False, micro=1, world=batch)
    line = bad_input_error(test_hosts, job, job["root"] / "bad_batch", HL_DS_CONFIG=str(ds_config))
    assert (f"train_batch_size {batch} is not a multiple of train_micro_batch_size_per_gpu 1 x world size "
            f"{job['ranks']}") in line, line

    # The data reached through a directory that host 3 lacks (a tmpfs hides it there)
    hidden = job["root"] / "mounted"
    hidden.mkdir()
    (hidden / "data").symlink_to(job["data"])
    with test_hosts.without(2, hidden):
        line = bad_input_error(test_hosts, job, job["root"] / "bad_data", HL_DATA_DIR=str(hidden / "data"))
    assert line == f"error: preflight: host {addresses[2]}: data directory {hidden / 'data'} does not exist", line
