"""scripts/plot_dllogger.py: the PNG of a real run's dllogger JSON holds its loss and LR curves."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

import helpers
import run_pretraining as rp

SCRIPT = helpers.REPO_ROOT / "scripts" / "plot_dllogger.py"


def load_script():
    spec = importlib.util.spec_from_file_location("plot_dllogger", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_log(tmp_path_factory, tiny_shards):
    """The dllogger JSON of a real 8-step run (log every 2 steps, warm-up then decay of the LR)."""
    tmp_path = tmp_path_factory.mktemp("plot_run")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        config = helpers.write_ds_config(tmp_path / "ds.json", stage=0, bf16=False)
        rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out", config, json_summary=tmp_path / "log.json",
                                    max_steps=8, log_freq=2, skip_checkpoint=True))
    return tmp_path / "log.json"


def test_png_holds_the_loss_and_lr_points_of_the_log(run_log, tmp_path):
    records = helpers.step_records(run_log)
    steps = [r["step"][1] for r in records]
    assert steps == [2, 4, 6, 8]
    png = tmp_path / "plots" / "loss.png"
    figure = load_script().main([str(run_log), "-o", str(png)])
    loss_axes, lr_axes = figure.axes
    (loss_line,) = loss_axes.lines  # one rank: all_ranks_average_loss is the same curve, drawn once
    (lr_line,) = lr_axes.lines
    assert loss_line.get_xydata().tolist() == [[s, r["data"]["average_loss"]] for s, r in zip(steps, records)]
    assert lr_line.get_xydata().tolist() == [[s, r["data"]["learning_rate"]] for s, r in zip(steps, records)]
    # The file is a PNG of the figure's size, and the curves' colours are in it.
    import matplotlib.colors
    import matplotlib.image
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)[..., :3]
    assert pixels.shape == (600, 800, 3)
    for line in (loss_line, lr_line):
        colour = np.array(matplotlib.colors.to_rgb(line.get_color()))
        assert (np.abs(pixels - colour).max(axis=-1) < 0.02).sum() > 100, line.get_label()


def test_a_step_logged_twice_keeps_its_last_value(tmp_path):
    log = tmp_path / "resumed.json"
    log.write_text("".join("DLLL " + json.dumps({"type": "LOG", "step": [0, step],
                                                  "data": {"average_loss": loss, "learning_rate": 0.1}}) + "\n"
                           for step, loss in ((1, 9.0), (2, 8.0), (2, 7.5), (3, 7.0))))
    curves = load_script().read_curves(log)
    assert curves["average_loss"] == ([1, 2, 3], [9.0, 7.5, 7.0])


@pytest.mark.parametrize("content", [None, "no dllogger lines\n", 'DLLL {"type": "LOG", "step": [], "data": {}}\n'],
                         ids=["missing", "not_dllogger", "no_step_records"])
def test_unplottable_input_is_one_error_line(tmp_path, content):
    log = tmp_path / "log.json"
    if content is not None:
        log.write_text(content)
    result = subprocess.run([sys.executable, str(SCRIPT), str(log), "-o", str(tmp_path / "x.png")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
    assert not (tmp_path / "x.png").exists()


def test_held_out_figures_get_the_loss_points_and_a_panel_of_accuracies(tmp_path):
    """A run with --eval_dir logs eval records at some steps: eval_loss joins the losses, its accuracies get a
    third panel; a run without them keeps the two panels (above)."""
    records = [{"step": [0, step], "data": {"average_loss": 10.0 - step, "learning_rate": 0.1}}
               for step in (1, 2, 3, 4)]
    records += [{"step": [0, step], "data": {"eval_loss": 9.5 - step, "eval_mlm_loss": 9.0 - step,
                                             "eval_mlm_accuracy": 0.1 * step, "eval_nsp_accuracy": 0.5 + 0.01 * step}}
                for step in (2, 4)]
    log = tmp_path / "log.json"
    log.write_text("".join("DLLL " + json.dumps({"type": "LOG", **record}) + "\n" for record in records))
    figure = load_script().main([str(log), "-o", str(tmp_path / "loss.png")])
    loss_axes, _, accuracy_axes = figure.axes
    lines = {line.get_label(): line.get_xydata().tolist() for axes in figure.axes for line in axes.lines}
    assert [line.get_label() for line in loss_axes.lines] == ["average_loss", "eval_loss (held-out)"]
    assert lines["eval_loss (held-out)"] == [[2, 7.5], [4, 5.5]]
    assert [line.get_label() for line in accuracy_axes.lines] == ["eval_mlm_accuracy", "eval_nsp_accuracy"]
    assert np.allclose(lines["eval_mlm_accuracy"], [[2, 0.2], [4, 0.4]])
    assert np.allclose(lines["eval_nsp_accuracy"], [[2, 0.52], [4, 0.54]])
