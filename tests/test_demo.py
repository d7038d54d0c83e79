"""The README's main command, scripts/run_bert_tiny_cpu.sh, end to end: the offline data pipeline on the
committed sample corpus, then 2 CPU ranks through the real `deepspeed` launcher (ZeRO-1, bf16, LANS).
The demo is deterministic on a given CPU, so its losses must be the ones the documentation quotes wherever
the CPU's bf16 kernels are those of the machine that measured them (kernel_fingerprint)."""
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import helpers
from data.shard_format import read_shard_header
from test_resume import finish, output_until

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results.md"
# The rows of the results file that quote the demo's losses (default 120 steps, logged every 10).
QUOTED_ROWS = {"first": "demo loss, mean of steps 1–10", "last": "demo loss, mean of steps 111–120",
               "final": "demo `final_loss`, mean over both ranks"}
UNIFORM_GUESS = re.compile(r"ln\(30522\) \+ ln\(2\) = (\d+\.\d+)")
FINGERPRINT_ROW = "bf16 kernel fingerprint of the machine that measured the demo losses"
# On other bf16 kernels the first window may differ by their rounding alone (measured: 4e-5, docs/results.md),
# within the quoted figure's rounding (5e-4) and as much again.
FIRST_WINDOW_TOLERANCE = 1e-3


def quoted_figures(text: str) -> dict:
    """The demo's quoted losses: the value cell of each row of QUOTED_ROWS, which must occur exactly once."""
    figures = {}
    for key, label in QUOTED_ROWS.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
        assert len(rows) == 1, f"{RESULTS}: {len(rows)} rows '{label}'"
        figures[key] = rows[0].split("|")[2].strip()
        assert re.fullmatch(r"\d+\.\d+", figures[key]), rows[0]
    return figures


def quoted_uniform_guess(text: str) -> str:
    (value,) = UNIFORM_GUESS.findall(text)
    return value


def test_results_file_quotes_the_demo_figures():
    """The parsing the slow test relies on finds the figures in the results file."""
    text = RESULTS.read_text()
    assert set(quoted_figures(text)) == {"first", "last", "final"}
    assert quoted_uniform_guess(text) == f"{math.log(30522) + math.log(2):.3f}"
    figures = quoted_figures(text)
    assert stale_figures({key: float(value) for key, value in figures.items()}, figures) == []
    assert len(stale_figures({key: float(value) + 0.001 for key, value in figures.items()}, figures)) == 3
    # The demo's losses on a CPU without bf16 instructions (docs/results.md): stale against the quoted figures
    # on the kernels that measured them, consistent with them on other kernels; a first window that moved is not.
    ours, other = quoted_fingerprint(text), "0" * 16
    without_bf16 = {"first": 10.847168159484863, "last": 7.285353422164917, "final": 7.227994394302368}
    assert demo_figure_problems({key: float(value) for key, value in figures.items()}, text, ours) == []
    assert len(demo_figure_problems(without_bf16, text, ours)) == 2
    assert demo_figure_problems(without_bf16, text, other) == []
    assert len(demo_figure_problems(dict(without_bf16, first=float(figures["first"]) + 0.002), text, other)) == 1
    # Negative control: a second row with the same label, or a value that is not a figure, is refused.
    row = next(line for line in text.splitlines() if line.startswith(f"| {QUOTED_ROWS['last']} |"))
    for broken in (text + row + "\n", text.replace(row, row.replace("7.", "seven ", 1))):
        with pytest.raises(AssertionError):
            quoted_figures(broken)


def kernel_fingerprint() -> str:
    """A digest of bf16 results on one thread (as each demo rank runs): products with the demo's inner
    dimensions (hidden 128, intermediate 512, and longer sums, as in the weight gradients), then softmax,
    GELU and layer norm. Another CPU's kernels (no bf16 instructions, AMX, another ISA) round some of them
    differently, and the demo's losses then follow another trajectory (docs/results.md): equal digests, the
    same kernels as the machine that measured the quoted losses."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        results = []
        for m, k, n in ((4096, 128, 512), (4096, 512, 128), (128, 4096, 512), (640, 128, 30522)):
            inputs = torch.randn(m, k, generator=generator).bfloat16()
            weight = torch.randn(n, k, generator=generator).bfloat16()
            results.append(torch.nn.functional.linear(inputs, weight))
        last = results[-1]
        results += [torch.softmax(last, -1), torch.nn.functional.gelu(last),
                    torch.nn.functional.layer_norm(last, last.shape[-1:])]
        return hashlib.sha256(b"".join(result.float().numpy().tobytes() for result in results)).hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


def quoted_fingerprint(text: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {FINGERPRINT_ROW}")]
    assert len(rows) == 1, f"{RESULTS}: {len(rows)} rows '{FINGERPRINT_ROW}'"
    value = rows[0].split("|")[2].strip()
    assert re.fullmatch(r"[0-9a-f]{16}", value), rows[0]
    return value


def demo_figure_problems(measured: dict, text: str, fingerprint: str) -> list:
    """What the measured losses contradict in the results file: on the kernels that measured the quoted
    figures, every figure that the run does not reproduce (a stale figure); on other kernels, only a first
    window further than FIRST_WINDOW_TOLERANCE from the quoted one (the later windows part: 0.145 apart at
    steps 71-80 without bf16 instructions)."""
    quotes = quoted_figures(text)
    if fingerprint == quoted_fingerprint(text):
        return stale_figures(measured, quotes)
    if abs(measured["first"] - float(quotes["first"])) > FIRST_WINDOW_TOLERANCE:
        return [f"first: quoted {quotes['first']}, measured {measured['first']:.6f} (other bf16 kernels: within "
                f"{FIRST_WINDOW_TOLERANCE})"]
    return []


def stale_figures(measured: dict, quotes: dict) -> list:
    """The quoted figures that the measured values, rounded as quoted, do not reproduce."""
    return [f"{key}: quoted {text}, measured {measured[key]:.6f}" for key, text in quotes.items()
            if f"{measured[key]:.{len(text.split('.')[1])}f}" != text]


def start_demo(tmp_path, **settings) -> subprocess.Popen:
    """The demo's script in a process group of its own, stdout and stderr together in one pipe."""
    # PYTHONPATH: the demo's processes import this checkout as the suite does, and setup_venv.sh, finding the
    # project importable, leaves the environment as it is (no editable install into the suite's environment).
    env = dict(helpers.checkout_env(), VENV=sys.prefix, RESULTS_DIR=str(tmp_path / "results"),
               MASTER_PORT=str(helpers.free_port()), **settings)
    return subprocess.Popen(["bash", str(REPO / "scripts" / "run_bert_tiny_cpu.sh")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_demo(tmp_path, **settings) -> subprocess.CompletedProcess:
    """The demo to its end; its output, stdout and stderr together. A run still going after 600 s (the
    test's four runs take 2-3.5 minutes in all here and in CI; a slower CPU must not fail it) fails the
    test, with its output, and is killed with its ranks (a timeout of subprocess.run would kill the script
    alone and leave them running)."""
    process = start_demo(tmp_path, **settings)
    status, output = finish(process, timeout=600)
    assert status == 0, output[-6000:]
    return subprocess.CompletedProcess(process.args, status, output)


def sigterm_demo_once_training(tmp_path, **settings) -> subprocess.CompletedProcess:
    """run_demo's command, SIGTERM to the script itself at its first logged training window; its status and
    output (stdout and stderr together)."""
    process = start_demo(tmp_path, **settings)
    try:
        output = output_until(process, lambda text: "Training Iteration" in text)
        process.send_signal(signal.SIGTERM)
        status, rest = finish(process)
        return subprocess.CompletedProcess(process.args, status, output + rest)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left if an assertion failed
            os.killpg(process.pid, signal.SIGKILL)


def tensorboard_scalars(directory, tag) -> list:
    """(step, value) of one scalar in the TensorBoard event files under `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (run_dir,) = {path.parent for path in Path(directory).rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.mark.slow
def test_tiny_cpu_demo_builds_data_trains_and_checkpoints(tmp_path):
    results = tmp_path / "results"
    run = run_demo(tmp_path)  # the README's command as it stands: 120 steps

    # The shards came out of the whole pipeline (WikiExtractor, sharding, create_pretraining_data).
    shards = sorted(results.rglob("books_wiki_en_corpus_training_*.hdf5"))
    assert shards and all(read_shard_header(path)[1:] == (128, 20) for path in shards)
    assert (results / "data" / "extracted").is_dir()

    records = [json.loads(line[5:]) for line in (results / "dllogger.json").read_text().splitlines()
               if line.startswith("DLLL ")]
    windows = [r["data"]["average_loss"] for r in records if r["type"] == "LOG" and "average_loss" in r["data"]]
    summary = [r["data"] for r in records if r["type"] == "LOG" and r["step"] == []][-1]
    assert len(windows) == 12 and summary["global_step"] == 120
    # The losses the documentation quotes are this run's (a stale figure fails here), on the bf16 kernels that
    # measured them; another CPU's kernels give other losses, and only the first window is compared there.
    measured = {"first": windows[0], "last": windows[-1], "final": summary["final_loss"]}
    fingerprint = kernel_fingerprint()
    assert demo_figure_problems(measured, RESULTS.read_text(), fingerprint) == []
    if fingerprint != quoted_fingerprint(RESULTS.read_text()):
        warnings.warn(f"only the demo's first window was compared with the quoted losses: this CPU's bf16 kernels "
                      f"(fingerprint {fingerprint}) are not those that measured them; this run: {measured}",
                      stacklevel=1)
    # The loss of a uniform guess (MLM + next sentence), as the demo prints it and the documentation quotes it.
    uniform = f"{math.log(30522) + math.log(2):.3f}"
    assert UNIFORM_GUESS.search(run.stdout).group(1) == quoted_uniform_guess(RESULTS.read_text()) == uniform
    # Training learns: the loss starts below that guess and falls clearly.
    assert float(uniform) > windows[0] > 10.0
    assert windows[-1] < windows[0] - 1.0
    for key in ("e2e_train_time", "training_sequences_per_second", "raw_train_time", "final_loss"):
        assert key in summary
    assert (results / "checkpoints" / "latest").read_text().strip() == "120"
    assert "final_loss" in run.stdout
    # TensorBoard got the same windows as the dllogger JSON; the PNG was written.
    logged = [(r["step"][1], r["data"]["average_loss"]) for r in records if "average_loss" in r["data"]]
    assert [(step, pytest.approx(value)) for step, value in tensorboard_scalars(results / "tensorboard",
                                                                                "Train/average_loss")] == logged
    assert (results / "loss.png").read_bytes()[:4] == b"\x89PNG"

    # A re-run resumes (as every launcher does); a larger MAX_STEPS extends the run: the LR follows the new
    # schedule (it was 0 past the old end) and the dllogger JSON keeps the first run's records.
    resumed = run_demo(tmp_path, MAX_STEPS="130")
    change = re.search(r"the LR schedule changed since the checkpoint \(--max_steps 120 -> 130\): from step 121 on, "
                       r"the LR follows the new flags \(0 -> (\S+) at that step\)", resumed.stdout)
    assert change, resumed.stdout[-3000:]
    assert float(change.group(1)) == pytest.approx(0.02 * (1 - 121 / 130) / 0.9, rel=1e-3)  # PolyWarmUp
    steps = helpers.step_records(results / "dllogger.json")
    assert [r["step"][1] for r in steps] == list(range(10, 131, 10))
    assert steps[-1]["data"]["average_loss"] < windows[0]
    assert (results / "checkpoints" / "latest").read_text().strip() == "130"

    # Phase 2 continues from phase 1's checkpoint 130 on the sample's 512/80 shards, in results/phase2; a run
    # shorter than the demo's 10-step log interval logs its last step, so that its plot has a loss to draw.
    run_demo(tmp_path, PHASE="2", MAX_STEPS="4")
    assert all(read_shard_header(path)[1:] == (512, 80)
               for path in results.rglob("*seq_len_512*/books_wiki_en_corpus/*training*.hdf5"))
    phase2 = results / "phase2"
    assert (phase2 / "checkpoints" / "latest").read_text().strip() == "134"  # tags continue after phase 1's
    assert (results / "checkpoints" / "latest").read_text().strip() == "130"  # phase 1 untouched
    steps = helpers.step_records(phase2 / "dllogger.json")
    assert [r["step"][1] for r in steps] == [4]
    assert math.isfinite(steps[0]["data"]["average_loss"]) and steps[0]["data"]["average_loss"] < windows[0]
    assert (phase2 / "loss.png").exists() and tensorboard_scalars(phase2 / "tensorboard", "Train/average_loss")

    # SIGTERM to the demo's script alone (as a scheduler sends it) once phase 1 trains again: the ranks save
    # a checkpoint and exit 0, and the demo still prints its summary. Formerly the script died at once (143)
    # and left its ranks running, with nothing saved.
    stopped = sigterm_demo_once_training(tmp_path, MAX_STEPS="1000")
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    summary = [r["data"] for r in helpers.read_dllogger(results / "dllogger.json")
               if r["type"] == "LOG" and r["step"] == []][-1]
    assert summary["stopped_by_signal"] is True and 140 <= summary["global_step"] < 1000
    assert (results / "checkpoints" / "latest").read_text().strip() == str(summary["global_step"])
    assert "== summary" in stopped.stdout
