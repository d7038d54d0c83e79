"""--enable_torch_compile (the reference's compile mode) with the real DeepSpeed engine and inductor on the CPU.

Compiled training must follow eager training step by step (inductor reorders float sums, so within a
float tolerance, not bitwise), and the checkpoints must be the same files: a run saved in one mode
resumes in the other. Inductor needs the C++ compiler that the venv's torch finds (g++ here).
"""


import pytest
import torch

import helpers
import run_pretraining
from common.errors import InputError
from training import pretraining_config

STEPS, HALF = 20, 10
# Relative loss difference allowed per step: fp32 sums in another order; bf16 rounds its (differently
# fused) intermediate results to 8 bits of mantissa.
TOLERANCE = {False: 1e-4, True: 2e-2}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compile_shards")
    helpers.write_synthetic_shards(directory, (48, 40))
    return directory


def train(shards, tmp_path, output, log, bf16, compiled, **flags):
    config = helpers.write_ds_config(tmp_path / f"ds_{bf16}.json", stage=1, bf16=bf16, micro=4)
    argv = helpers.driver_argv(shards, tmp_path / output, config, tmp_path / log, max_steps=STEPS,
                               enable_torch_compile=compiled, num_steps_per_checkpoint=HALF, **flags)
    return run_pretraining.main([str(arg) for arg in argv])


def losses(*logs) -> dict:
    return {r["step"][-1]: r["data"]["step_loss"] for log in logs for r in helpers.step_records(log)}


@pytest.mark.slow  # five tiny runs, two compiled: minutes on a busy 2-core machine
@pytest.mark.parametrize("bf16", [pytest.param(False, id="fp32"), pytest.param(True, id="bf16")])
def test_compiled_training_follows_eager_and_checkpoints_resume_in_either_mode(tmp_path, shards, bf16):
    """Eager for 20 steps; compiled for 10 then resumed eager from its checkpoint; eager for 10 then resumed
    compiled. Every step's loss matches the eager run, and the compiled run's checkpoint has eager's keys."""
    train(shards, tmp_path, "eager", "eager.json", bf16, compiled=False)
    train(shards, tmp_path, "a", "a1.json", bf16, compiled=True, steps_this_run=HALF)
    model_states = torch.load(tmp_path / "a" / str(HALF) / "mp_rank_00_model_states.pt", weights_only=False)
    assert not [key for key in model_states["module"] if "_orig_mod" in key]
    train(shards, tmp_path, "a", "a2.json", bf16, compiled=False, resume_from_checkpoint=True)
    train(shards, tmp_path, "b", "b1.json", bf16, compiled=False, steps_this_run=HALF)
    train(shards, tmp_path, "b", "b2.json", bf16, compiled=True, resume_from_checkpoint=True)
    expected = losses(tmp_path / "eager.json")
    assert sorted(expected) == list(range(1, STEPS + 1))
    for logs in (("a1.json", "a2.json"), ("b1.json", "b2.json")):
        got = losses(*(tmp_path / log for log in logs))
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=TOLERANCE[bf16])
    first_step = [r for r in helpers.read_dllogger(tmp_path / "a1.json") if "first_step_time_s" in r.get("data", {})]
    assert len(first_step) == 1 and first_step[0]["data"]["first_step_time_s"] > 0


@pytest.mark.parametrize("torch_compile,compiled_update", [(None, False), ((None, None), True),
                                                          (("aot_eager", None), False)])
def test_compile_mode_with_inductor_compiles_the_lans_update(tmp_path, shards, torch_compile, compiled_update):
    """The driver's LANS runs its update compiled in compile mode when the backend is inductor (the default
    off Gaudi); the 20-step comparison above then covers it."""
    from training import distributed
    config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=True, micro=4)
    args = run_pretraining.parse_arguments([str(arg) for arg in helpers.driver_argv(shards, tmp_path / "out", config)])
    run_config = pretraining_config.build_config(args, 1)
    distributed.setup_device_and_distributed(distributed.Job(), args.use_hpu, args.no_cuda, args.local_rank)
    engine, optimizer = run_pretraining.build_engine(
        run_pretraining.build_model(run_config.model_config, None, 0), run_config.ds_config, optimizer_name="lans",
        learning_rate=0.01, betas=None, lr_schedule=None, lans_blocks="tensor", torch_compile=torch_compile)
    engine.destroy()  # else DeepSpeed's gradient hooks keep it alive for the worker's later files
    assert optimizer.compile_update is compiled_update


@pytest.mark.parametrize("flags,message", [
    ({"torch_compile_mode": "max-autotune"}, "need --enable_torch_compile"),
    ({"enable_torch_compile": True, "torch_compile_mode": "fastest"}, "--torch_compile_mode must be one of"),
    ({"enable_torch_compile": True, "torch_compile_backend": "no_such_backend"}, "--torch_compile_backend"),
])
def test_bad_compile_flags_are_refused_before_training(tmp_path, shards, flags, message):
    config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False, micro=4)
    argv = helpers.driver_argv(shards, tmp_path / "out", config, tmp_path / "log.json", **flags)
    with pytest.raises(InputError, match=message):
        run_pretraining.main([str(arg) for arg in argv])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_compile_help_names_the_lans_update_where_it_is_compiled():
    """Only run_pretraining.py compiles an optimizer update (LANS's); fine-tuning's AdamW stays eager."""
    import run_glue
    import run_squad

    def compile_help(parser):
        (action,) = [a for a in parser._actions if "--enable_torch_compile" in a.option_strings]
        return action.help

    assert "the LANS update" in compile_help(run_pretraining.build_parser())
    assert all("LANS" not in compile_help(module.build_parser()) for module in (run_glue, run_squad))


def test_fine_tuning_compiled_follows_eager(tmp_path, monkeypatch):
    """run_glue.py (finetune/finetuning.py's loop, which run_squad.py shares): the same losses and dev predictions."""
    import run_glue
    from finetune_helpers import TINY_CONFIG, write_sst2_rule_task
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    data = write_sst2_rule_task(tmp_path / "data", 64, 16)
    summaries = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        summaries[compiled] = run_glue.main(helpers.flags_to_argv({
            "task_name": "sst-2", "data_dir": data, "vocab_file": helpers.REPO_ROOT / "data" / "vocab.txt",
            "do_lower_case": True, "output_dir": out, "do_train": True, "do_eval": True, "max_seq_length": 32,
            "train_batch_size": 16, "learning_rate": 5e-4, "no_cuda": True, "disable-progress-bar": True,
            "log_freq": 1, "config_file": TINY_CONFIG, "max_steps": 4, "enable_torch_compile": compiled}))
    eager, compiled = summaries[False], summaries[True]
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert compiled["acc"] == eager["acc"]
