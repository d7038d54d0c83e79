"""Gaudi lazy mode without a Gaudi: the mark_step calls of the training step (training/gaudi.py) and the environment
the launchers set for HL_DEVICE=hpu.

The recording stand-in for Habana's bridge is tests/fake_habana (its docstring says what it models); it is
put on the path only by these tests. What it cannot show: that the cuts help on a real Gaudi (no device,
no graphs), and anything past the process group's start with --use_hpu (no hccl backend here).
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import helpers
import run_pretraining as rp
from common.errors import NO_RESTART_MARK
from training import gaudi
from training.run_status import ExitStatus

FAKE_HABANA = helpers.FAKE_HABANA


@pytest.fixture
def fake_bridge(monkeypatch):
    """The stand-in bridge importable in this process, its CALLS list emptied; gone again afterwards."""
    monkeypatch.syspath_prepend(str(FAKE_HABANA))
    for name in [name for name in sys.modules if name.startswith("habana_frameworks")]:
        monkeypatch.delitem(sys.modules, name)
    import habana_frameworks
    habana_frameworks.CALLS.clear()
    yield habana_frameworks.CALLS
    forget_fake_bridge()


def forget_fake_bridge():
    """Drops the stand-in's modules from sys.modules. Not through monkeypatch: its undo puts back what it
    deleted, which would leave the stand-in imported for every later test (checkpointing would then look
    for hpu.random, as on a Gaudi)."""
    for name in [name for name in sys.modules if name.startswith("habana_frameworks")]:
        del sys.modules[name]


def expected_calls(steps: int, gas: int, bert_5b: bool) -> list:
    """The reference's order (1.9.0 run_pretraining.py / modeling.py) per micro-batch: forward, [5B: cut
    before and after the loss; the LM head's backward hook], backward, cut, engine.step() (the optimizer
    steps at the last micro-batch), cut."""
    calls = []
    for _ in range(steps):
        for micro in range(gas):
            calls += ["forward"] + ["mark_step"] * 2 * bert_5b + ["mark_step"] * bert_5b + ["backward", "mark_step"]
            calls += ["optimizer.step"] * (micro == gas - 1) + ["mark_step"]
    return calls


@pytest.mark.parametrize("gas,bert_5b", [(1, False), (3, False), (2, True)])
def test_lazy_mode_cuts_the_graph_where_the_reference_does(tmp_path, tiny_shards, fake_bridge, monkeypatch, gas,
                                                            bert_5b):
    """The real driver on the CPU with the lazy-mode graph breaks of an HPU (the factory's device choice is
    tested below): the order and count of mark_step among forward, backward and optimizer steps."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    calls = fake_bridge

    def lazy_breaks_with_observers(device, model, is_5b):
        model.register_forward_pre_hook(lambda module, inputs: calls.append("forward"))
        # the encoder's input gradient is the last thing backward computes before the embeddings
        model.bert.encoder.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append("backward"))
        return gaudi.LazyModeGraphBreaks(model, is_5b)

    config = helpers.TINY_MODEL_CONFIG
    if bert_5b:  # the reference decides "5B" by the config file's name
        config = tmp_path / "bert_5b_config.json"
        config.write_text(helpers.TINY_MODEL_CONFIG.read_text())
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=4, gas=gas)
    # under DeepSpeed the global hooks fire twice per LANS step (its step counter moves once): note it once
    steps_seen = set()

    def note_step(optimizer, *_):
        if optimizer.param_groups[0]["step"] not in steps_seen:
            steps_seen.add(optimizer.param_groups[0]["step"])
            calls.append("optimizer.step")

    hook = register_optimizer_step_post_hook(note_step)
    try:
        rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, config_file=config, max_steps=2,
                                    skip_checkpoint=True), make_graph_breaks=lazy_breaks_with_observers)
    finally:
        hook.remove()
    assert calls == expected_calls(steps=2, gas=gas, bert_5b=bert_5b), calls


def test_graph_breaks_only_on_an_hpu_in_lazy_mode(fake_bridge, monkeypatch):
    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert type(gaudi.graph_breaks(torch.device("hpu"), model, False)) is gaudi.LazyModeGraphBreaks
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")  # compile (or eager) mode: the bridge makes its own graphs
    assert type(gaudi.graph_breaks(torch.device("hpu"), model, False)) is gaudi.NoGraphBreaks
    assert fake_bridge == []  # asked for the mode, never cut
    forget_fake_bridge()
    for device in ("cpu", "cuda"):
        breaks = gaudi.graph_breaks(torch.device(device), model, True)
        with breaks.around_loss():
            breaks.after_backward()
            breaks.after_step()
    assert fake_bridge == [] and not [name for name in sys.modules if name.startswith("habana_frameworks")]


@pytest.mark.parametrize("lazy_mode,expected", [("1", ["mark_step", "synchronize"]), ("0", ["synchronize"])])
def test_the_peak_measurement_waits_for_the_hpu(fake_bridge, monkeypatch, lazy_mode, expected):
    """hardware.measure_matmul_tflops ends each timed product with hardware.wait_for(device): on an HPU in lazy
    mode a cut and then the device's synchronize (else it would time the recording of the graph), in compile
    mode the synchronize alone."""
    from training import hardware
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy_mode)
    hardware.wait_for(torch.device("hpu"))()
    assert fake_bridge == expected


def test_the_reference_5b_test_is_the_config_file_name():
    assert gaudi.is_bert_5b("scripts/bert_5b_config.json")
    assert not gaudi.is_bert_5b("scripts/bert_1.5b_config.json")


def test_nothing_of_habana_runs_on_the_cpu(tmp_path, tiny_shards, monkeypatch):
    """A whole CPU run (5B config name, PT_HPU_LAZY_MODE=1) with the stand-in importable: never imported."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.syspath_prepend(str(FAKE_HABANA))
    for name in [name for name in sys.modules if name.startswith("habana_frameworks")]:
        monkeypatch.delitem(sys.modules, name)
    config = tmp_path / "bert_5b_config.json"
    config.write_text(helpers.TINY_MODEL_CONFIG.read_text())
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=4, gas=2)
    summary = rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, config_file=config, max_steps=1,
                                          skip_checkpoint=True))
    assert summary["global_step"] == 1
    assert not [name for name in sys.modules if name.startswith("habana_frameworks")]


@pytest.mark.parametrize("lazy_mode", [None, "1", "0"])
def test_compile_mode_on_an_hpu_is_refused_under_lazy_mode_before_the_bridge_is_imported(
        tmp_path, tiny_shards, capsys, monkeypatch, lazy_mode):
    """--use_hpu --enable_torch_compile: under lazy mode (PT_HPU_LAZY_MODE=1, or unset, which the launchers
    also read as 1) one error line that says how to get compile mode, before the bridge is imported. With
    PT_HPU_LAZY_MODE=0 validation lets it through: the next error is the stand-in's missing hccl."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # --use_hpu would ask DeepSpeed for its HPU accelerator
    if lazy_mode is None:
        monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    else:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy_mode)
    monkeypatch.syspath_prepend(str(FAKE_HABANA))
    forget_fake_bridge()
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    try:
        exit_code = rp.cli(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, use_hpu=True, no_cuda=False,
                                               enable_torch_compile=True))
        imported = [name for name in sys.modules if name.startswith("habana_frameworks")]
    finally:
        forget_fake_bridge()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_code == ExitStatus.NO_RESTART and len(errors) == 1, errors
    if lazy_mode == "0":
        assert "--use_hpu needs the SynapseAI PyTorch bridge" in errors[0] and imported
    else:
        shown = "unset, read as lazy mode" if lazy_mode is None else "'1'"
        assert errors[0] == ("error: --enable_torch_compile with --use_hpu needs Gaudi's compile mode, "
                             f"PT_HPU_LAZY_MODE=0 (here PT_HPU_LAZY_MODE is {shown}) [no restart]")
        assert imported == []
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry_point", ["run_glue", "run_squad"])
def test_fine_tuning_refuses_compile_mode_on_an_hpu_under_lazy_mode(tmp_path, capsys, monkeypatch, entry_point):
    """The fine-tuning entry points share the check (flags.build_config): the same one line, before any input
    file is read (these do not exist) and before the bridge is imported."""
    import importlib
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.syspath_prepend(str(FAKE_HABANA))
    forget_fake_bridge()
    missing = tmp_path / "missing"
    argv = ["--use_hpu", "--enable_torch_compile", "--do_train", "--init_checkpoint", str(missing), "--vocab_file",
            str(missing), "--output_dir", str(tmp_path / "out")]
    argv += (["--task_name", "MRPC", "--data_dir", str(missing)] if entry_point == "run_glue"
             else ["--train_file", str(missing)])
    assert importlib.import_module(entry_point).cli(argv) == ExitStatus.NO_RESTART
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --enable_torch_compile with --use_hpu needs Gaudi's compile mode, PT_HPU_LAZY_MODE=0 "
                      f"(here PT_HPU_LAZY_MODE is '1'){NO_RESTART_MARK}"]
    assert not [name for name in sys.modules if name.startswith("habana_frameworks")]


def test_lazy_mode_does_not_concern_compile_mode_off_the_hpu(monkeypatch):
    """On the CPU or CUDA, PT_HPU_LAZY_MODE=1 (left over from a Gaudi shell) does not refuse compile mode, and
    nothing of Habana is imported to decide it."""
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.syspath_prepend(str(FAKE_HABANA))
    forget_fake_bridge()
    from training import compile_mode
    compile_mode.check_compile_flags(True, None, None, use_hpu=False)
    compile_mode.check_compile_flags(False, None, None, use_hpu=True)  # eager under lazy mode: the default
    assert not [name for name in sys.modules if name.startswith("habana_frameworks")]


@pytest.mark.parametrize("value,lazy", [(None, True), ("1", True), ("0", False)])
def test_the_mode_requested_by_the_environment(value, lazy):
    """As scripts/launch_common.sh reads it: unset is lazy mode, 0 is compile mode."""
    assert gaudi.lazy_mode_requested({} if value is None else {"PT_HPU_LAZY_MODE": value}) is lazy


# ---------------------------------------------------------------------------------------------- launchers

@pytest.fixture
def recording_deepspeed(tmp_path):
    """A `deepspeed` first on PATH that writes its arguments, one per line, to tmp_path/args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path / "args"}\n')
    (bin_dir / "deepspeed").chmod(0o755)
    (tmp_path / "data").mkdir()
    env = dict(helpers.environ_without_rank(),
               PATH=os.pathsep.join([str(bin_dir), str(helpers.VENV_BIN), os.environ["PATH"]]),
               HL_DATA_DIR=str(tmp_path / "data"), HL_RESULTS_DIR=str(tmp_path / "results"), HL_PREFLIGHT="0",
               HL_NUM_NODES="1", PYTHONPATH=str(FAKE_HABANA))  # the launchers' device check finds 8 Gaudis
    for name in HPU_SETTINGS:
        env.pop(name, None)
    return env, tmp_path


HPU_SETTINGS = ("PT_HPU_LAZY_MODE", "PT_HPU_POOL_MEM_ACQUIRE_PERC", "ENABLE_EXPERIMENTAL_FLAGS",
                "DISABLE_TENSOR_SIZE_VALIDATION")
MEMORY_SETTINGS_5B = ["PT_HPU_POOL_MEM_ACQUIRE_PERC=100", "ENABLE_EXPERIMENTAL_FLAGS=true",
                      "DISABLE_TENSOR_SIZE_VALIDATION=true"]


def rank_command(script, env, tmp_path) -> tuple:
    """(the `env` settings before the ranks' python, run_pretraining.py's arguments) of a launcher."""
    result = subprocess.run(["bash", str(helpers.REPO_ROOT / "scripts" / script)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    python_at = args.index(str(helpers.VENV_BIN / "python"))
    settings = args[args.index("env") + 1:python_at] if "env" in args else None
    return settings, args[python_at + 3:]


@pytest.mark.parametrize("script,bert_5b", [("run_bert_1.5b_8x.sh", False), ("run_bert_1.5b_32x.sh", False),
                                            ("run_bert_1.5b_8x_phase2.sh", False), ("run_bert_5b_128x.sh", True)])
def test_launchers_set_the_reference_environment_of_lazy_mode_by_default(recording_deepspeed, script, bert_5b):
    env, tmp_path = recording_deepspeed
    if "phase2" in script:
        (tmp_path / "results" / "checkpoints").mkdir(parents=True)
        (tmp_path / "results" / "checkpoints" / "latest").write_text("155000")
    settings, program = rank_command(script, env, tmp_path)
    assert settings == ["PT_HPU_LAZY_MODE=1"] + MEMORY_SETTINGS_5B * bert_5b
    assert "--use_hpu" in program and "--enable_torch_compile" not in program


def test_compile_mode_sets_lazy_mode_off_and_passes_the_compile_flag(recording_deepspeed):
    env, tmp_path = recording_deepspeed
    settings, program = rank_command("run_bert_5b_128x.sh", dict(env, PT_HPU_LAZY_MODE="0"), tmp_path)
    assert settings == ["PT_HPU_LAZY_MODE=0"]  # the 5B memory settings belong to lazy mode (1.9.0)
    assert "--use_hpu" in program and "--enable_torch_compile" in program


def test_a_users_own_settings_win(recording_deepspeed):
    env, tmp_path = recording_deepspeed
    env.update(PT_HPU_POOL_MEM_ACQUIRE_PERC="90", DISABLE_TENSOR_SIZE_VALIDATION="false")
    settings, _ = rank_command("run_bert_5b_128x.sh", env, tmp_path)
    assert settings == ["PT_HPU_LAZY_MODE=1", "PT_HPU_POOL_MEM_ACQUIRE_PERC=90", "ENABLE_EXPERIMENTAL_FLAGS=true",
                        "DISABLE_TENSOR_SIZE_VALIDATION=false"]
    # the 5B test is the config file's name, as in the reference: another 5B-named config gets the settings too
    config = tmp_path / "my_bert_5b_config.json"
    config.write_text("{}")
    settings, _ = rank_command("run_bert_1.5b_8x.sh", dict(env, HL_MODEL_CONFIG=str(config)), tmp_path)
    assert settings[3] == "DISABLE_TENSOR_SIZE_VALIDATION=false" and len(settings) == 4


def test_no_habana_setting_off_the_hpu(recording_deepspeed):
    """HL_DEVICE=cpu (cuda takes the same branch; the launchers' device check refuses it on this machine)."""
    env, tmp_path = recording_deepspeed
    settings, program = rank_command("run_bert_1.5b_8x.sh", dict(env, HL_DEVICE="cpu", PT_HPU_LAZY_MODE="0"),
                                     tmp_path)
    assert settings is None and "--no_cuda" in program
    assert "--use_hpu" not in program and "--enable_torch_compile" not in program


def test_an_unknown_lazy_mode_value_is_one_clear_error(recording_deepspeed):
    env, tmp_path = recording_deepspeed
    result = subprocess.run(["bash", str(helpers.REPO_ROOT / "scripts" / "run_bert_1.5b_8x.sh")],
                            env=dict(env, PT_HPU_LAZY_MODE="yes"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and not (tmp_path / "args").exists()
    assert result.stderr == "error: PT_HPU_LAZY_MODE must be 1 (lazy mode) or 0 (compile mode), not 'yes'\n"


# ---------------------------------------------------------------------------------------------- compile mode

COMPILE_WITH_HPU = """
import torch
from training import compile_mode, device_setup

device_setup.choose_accelerator(use_hpu=True, no_cuda=False)  # what --use_hpu does before DeepSpeed's import


class Engine:  # DeepSpeedEngine.compile's one step, which needs an HPU to build the real engine
    def __init__(self, module):
        self.module = module

    def compile(self, backend, compile_kwargs):
        self.module.compile(backend=backend, **compile_kwargs)


print(compile_mode.compile_model(Engine(torch.nn.Linear(4, 4)), None, None))
"""


def test_compile_mode_on_an_hpu_asks_for_the_hpu_backend():
    """compile_mode.compile_model with DeepSpeed's real HPU accelerator (built on the stand-in bridge) picks the
    bridge's registered hpu_backend. Not shown: the backend compiling a graph (nn.Module.compile did not call
    the stand-in backend in torch 2.13 here, even on a CPU module)."""
    env = helpers.launcher_env(PYTHONPATH=os.pathsep.join([str(helpers.REPO_ROOT), str(FAKE_HABANA)]))
    env.pop("DS_ACCELERATOR")
    result = subprocess.run([sys.executable, "-c", COMPILE_WITH_HPU], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "hpu_backend"
