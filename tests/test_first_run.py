"""bench/first_run.py, the first-run check for a new server, as CI runs it: the tiny config on the CPU, eager
mode (compile mode took 3.5 min there: inductor compiles on this CPU, and step 2 recompiled). And on a Gaudi
(no device needed): which pass runs in which of Habana's modes."""

import importlib.util
import subprocess
import sys

import pytest

import helpers


@pytest.mark.slow
def test_first_run_check_on_the_cpu_passes_every_check(tmp_path):
    result = subprocess.run([sys.executable, str(helpers.REPO_ROOT / "bench" / "first_run.py"), "--tiny", "--no_cuda",
                             "--modes", "eager", "--steps", "2", "--work_dir", str(tmp_path)],
                            env=helpers.launcher_env(), capture_output=True, text=True, timeout=600)
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [line.split(":")[1].strip() for line in verdicts] == ["finite loss", "MFU", "peak memory / planned"] * (
        len(verdicts) // 3) and verdicts and all(line.startswith("PASS") for line in verdicts)


def load_first_run():
    spec = importlib.util.spec_from_file_location("first_run", helpers.REPO_ROOT / "bench" / "first_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ON_GAUDI_COMPILE = "PT_HPU_LAZY_MODE=0 python bench/first_run.py --use_hpu"
ON_GAUDI_LAZY = "PT_HPU_LAZY_MODE=1 python bench/first_run.py --use_hpu"


@pytest.mark.parametrize("device,lazy_mode,wanted,runs,hint", [
    ("cpu", "1", ["eager", "compile"], ["eager", "compile"], None),  # a leftover Gaudi setting changes nothing
    ("cuda", None, ["eager", "compile"], ["eager", "compile"], None),
    ("hpu", None, ["eager", "compile"], ["eager"], ON_GAUDI_COMPILE),  # unset: lazy mode, as the launchers read it
    ("hpu", "1", ["eager", "compile"], ["eager"], ON_GAUDI_COMPILE),
    ("hpu", "0", ["eager", "compile"], ["compile"], ON_GAUDI_LAZY),
    ("hpu", "1", ["eager"], ["eager"], None),  # nothing wanted is left out: no SKIP line
    ("hpu", "0", ["compile"], ["compile"], None)])
def test_on_a_gaudi_each_pass_runs_only_in_its_own_mode(device, lazy_mode, wanted, runs, hint):
    """One process has one Gaudi mode: lazy mode runs the eager pass, PT_HPU_LAZY_MODE=0 the compile pass, and
    the pass left out is one SKIP line with the command that runs it. Off the HPU both passes run as before."""
    environ = {} if lazy_mode is None else {"PT_HPU_LAZY_MODE": lazy_mode}
    modes, skipped = load_first_run().planned_modes(wanted, device, True, environ)
    assert modes == runs
    if hint is None:
        assert skipped == []
    else:
        left_out = "compile" if runs == ["eager"] else "eager"
        assert len(skipped) == 1 and skipped[0].startswith(f"SKIP {left_out} mode:") and skipped[0].endswith(hint)


def test_compile_pass_under_lazy_mode_is_skipped_before_any_work(tmp_path, capsys, monkeypatch):
    """--use_hpu --modes compile in lazy mode: the SKIP verdict, exit 0, and no sample data built, no driver run
    (which would refuse compile mode here) and nothing of Habana imported."""
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    assert load_first_run().main(["--use_hpu", "--modes", "compile", "--work_dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("== verdicts (hpu;") and len(lines) == 2
    assert lines[1].startswith("SKIP compile mode:") and lines[1].endswith(ON_GAUDI_COMPILE)
    assert list(tmp_path.iterdir()) == []
    assert not [name for name in sys.modules if name.startswith("habana_frameworks")]


@pytest.mark.parametrize("modes", ["eagr", "", "eager,", "Compile", "eager compile"])
def test_a_mode_it_does_not_know_is_one_error_line_before_any_work(modes, tmp_path, capsys):
    """A misspelt --modes ran nothing and exited 0 with no verdict: it looked like a pass."""
    with pytest.raises(SystemExit) as exit_info:
        load_first_run().main(["--no_cuda", "--modes", modes, "--work_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--modes takes eager, compile" in errors[0] and repr(modes) in errors[0]
    assert list(tmp_path.iterdir()) == []
