"""Bad device set-ups are one error line before any work (training/device_setup.py): a DS_ACCELERATOR that names
another device than the run's, more processes on a server than it has CUDA devices, bf16 on a CUDA device
without it (training/hardware.py). The decisions are functions of their facts, tested here with those facts
as arguments; what a CPU machine can reach is also run through the real entry points."""

import importlib

import pytest

import helpers
from common.errors import NO_RESTART_MARK, HostInputError, InputError
from training import device_setup, hardware
from training.run_status import ExitStatus


def assert_decision(check, facts: tuple, expected: str | None) -> None:
    """check(*facts) passes when expected is None, else raises InputError with exactly that message."""
    if expected is None:
        check(*facts)
        return
    with pytest.raises(InputError) as raised:
        check(*facts)
    assert str(raised.value) == expected


# (DS_ACCELERATOR, use_hpu, no_cuda, cuda_available) -> the error line, or None where they agree
ACCELERATOR_CASES = {
    "unset": ((None, False, False, True), None),
    "cuda_on_cuda": (("cuda", False, False, True), None),
    "cpu_with_no_cuda": (("cpu", False, True, True), None),
    "cpu_without_cuda": (("cpu", False, False, False), None),
    "hpu_with_use_hpu": (("hpu", True, False, True), None),
    "cuda_without_cuda": (("cuda", False, False, False),
                          "DS_ACCELERATOR=cuda names another device than this run's, cpu (no CUDA device here): "
                          "unset DS_ACCELERATOR (the entry point sets it) or set it to cpu"),
    "cuda_with_no_cuda": (("cuda", False, True, True),
                          "DS_ACCELERATOR=cuda names another device than this run's, cpu (--no_cuda): "
                          "unset DS_ACCELERATOR (the entry point sets it) or set it to cpu"),
    "cpu_on_cuda": (("cpu", False, False, True),
                    "DS_ACCELERATOR=cpu names another device than this run's, cuda (CUDA is available here): "
                    "unset DS_ACCELERATOR (the entry point sets it) or set it to cuda, or pass --no_cuda to run "
                    "on cpu"),
    "hpu_without_use_hpu": (("hpu", False, False, True),
                            "DS_ACCELERATOR=hpu names another device than this run's, cuda (CUDA is available "
                            "here): unset DS_ACCELERATOR (the entry point sets it) or set it to cuda, or pass "
                            "--use_hpu to run on hpu"),
    "cpu_with_use_hpu": (("cpu", True, False, False),
                         "DS_ACCELERATOR=cpu names another device than this run's, hpu (--use_hpu): "
                         "unset DS_ACCELERATOR (the entry point sets it) or set it to hpu"),
}


@pytest.mark.parametrize("case", sorted(ACCELERATOR_CASES))
def test_ds_accelerator_must_name_the_device_of_the_run(case):
    assert_decision(device_setup.check_accelerator_variable, *ACCELERATOR_CASES[case])


@pytest.mark.parametrize("value", ["cuda", "hpu"])
def test_pretraining_with_a_ds_accelerator_of_another_device_is_one_error_line(tmp_path, tiny_shards, value):
    """`DS_ACCELERATOR=cuda python run_pretraining.py ...` on this CPU machine failed with a traceback from
    torch.cuda.set_device inside deepspeed.initialize, and DS_ACCELERATOR=hpu without --use_hpu with one from
    DeepSpeed's import (no habana_frameworks): now one line, before anything is written."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    output_dir = tmp_path / "out"
    argv = helpers.driver_argv(tiny_shards, output_dir, ds_config, no_cuda=False, max_steps=1)
    result = helpers.run_single_process(argv, env=helpers.launcher_env(DS_ACCELERATOR=value))
    assert result.returncode == ExitStatus.NO_RESTART, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: DS_ACCELERATOR={value} names another device than this run's, cpu (no CUDA device here): unset "
        f"DS_ACCELERATOR (the entry point sets it) or set it to cpu"
        f"{', or pass --use_hpu to run on hpu' if value == 'hpu' else ''} [no restart]"], result.stderr[-3000:]
    assert not output_dir.exists() and not (tmp_path / "dllogger.json").exists()


@pytest.mark.parametrize("entry_point", ["run_glue", "run_squad"])
def test_fine_tuning_with_a_ds_accelerator_of_another_device_is_one_error_line(tmp_path, capsys, monkeypatch,
                                                                               entry_point):
    """The fine-tuning entry points pick the accelerator through finetune/finetuning.py's parse_arguments, which
    calls the same device_setup.choose_accelerator: the same line, before any input file is read (these do not
         exist)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    missing = tmp_path / "missing"
    argv = ["--no_cuda", "--do_train", "--init_checkpoint", str(missing), "--vocab_file", str(missing),
            "--output_dir", str(tmp_path / "out")]
    argv += (["--task_name", "MRPC", "--data_dir", str(missing)] if entry_point == "run_glue"
             else ["--train_file", str(missing)])
    assert importlib.import_module(entry_point).cli(argv) == ExitStatus.NO_RESTART  # bad input, as in pretraining
    assert capsys.readouterr().err.splitlines() == [
        "error: DS_ACCELERATOR=cuda names another device than this run's, cpu (--no_cuda): unset DS_ACCELERATOR "
        f"(the entry point sets it) or set it to cpu{NO_RESTART_MARK}"]
    assert not (tmp_path / "out").exists()


# (LOCAL_RANK, processes on the server, visible CUDA devices) -> the error line, or None where they fit
CUDA_DEVICE_CASES = {
    "one_per_device": ((3, 4, 4), None),
    "fewer_than_devices": ((0, 2, 8), None),
    "no_launcher": ((0, 1, 1), None),
    "more_processes_than_devices": ((0, 4, 2), "4 processes on this server, one per CUDA device, but 2 visible "
                                    "CUDA device(s): start at most 2 processes per server (torchrun "
                                    "--nproc_per_node, deepspeed --num_gpus)"),
    "rank_beyond_devices_without_a_count": ((2, 1, 2), "LOCAL_RANK 2 takes CUDA device 2, but this server has 2 "
                                            "visible CUDA device(s): start at most 2 processes per server "
                                            "(torchrun --nproc_per_node, deepspeed --num_gpus)"),
}


@pytest.mark.parametrize("case", sorted(CUDA_DEVICE_CASES))
def test_each_process_of_a_server_needs_a_cuda_device_of_its_own(case):
    """What setup_device_and_distributed checks before torch.cuda.set_device (no CUDA here to run it on)."""
    assert_decision(device_setup.check_cuda_devices, *CUDA_DEVICE_CASES[case])


def test_a_server_short_of_cuda_devices_is_that_servers_fault():
    """A HostInputError (no NO_RESTART_MARK): where one server has lost or hidden a GPU, the supervisor's host
    check decides whether the job goes on without it."""
    with pytest.raises(HostInputError):
        device_setup.check_cuda_devices(0, 8, 7)


V100 = "Tesla V100-SXM2-32GB (compute capability 7.0)"
# (bf16.enabled, the device's bf16 support without emulation, the device) -> the error line, or None
BF16_CASES = {
    "bf16_where_supported": ((True, True, "NVIDIA H100 80GB HBM3 (compute capability 9.0)"), None),
    "fp32_without_bf16": ((False, False, V100), None),
    "bf16_without_bf16": ((True, False, V100), f"bf16.enabled is true in the --deepspeed_config JSON, but {V100} "
                          "has no native bf16 (torch would emulate it, far slower)"),
}


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bf16_needs_a_device_with_bf16(case):
    """What setup_device_and_distributed checks on a CUDA device, before the rendezvous and the engine (no
    CUDA here to run it on)."""
    assert_decision(hardware.check_bf16_support, *BF16_CASES[case])
