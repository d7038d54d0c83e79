"""World-size independence of run_pretraining.py (real `deepspeed` launcher, gloo, CPU): LANS with
--lans_blocks tensor follows the same losses on 1 rank without ZeRO and on 2 ranks with ZeRO-1/2
(and --lans_blocks partition does not), and a checkpoint written by W ranks resumes on W' ranks where
an uninterrupted run would be; so does compile mode on 2 ranks. Slow: about 9 launches and 6 in-process runs
of 20 tiny steps.

Every run keeps the global batch at 16 samples (micro-batch 4; the accumulation steps follow the
world size), fp32 runs use a model without dropout, so that the split of a batch between ranks
changes only the rounding. The LR is 0.002: at the driver tests' 0.01 LANS amplifies those rounding
differences to 2e-5 in the loss over 20 steps (measured: 1.9e-5; 3.8e-6 at 0.002, where partition blocks
differ by 1.2e-2).
"""

import contextlib
import io
import re
import shutil

import pytest
import torch

import helpers
import run_pretraining as rp
from test_driver_multirank import no_dropout_config
from training import checkpoint_export, checkpoint_resume, checkpointing

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, GLOBAL_BATCH, MICRO = 20, 10, 16, 4
FP32_TOLERANCE = 1e-5
# bf16: the ranks' micro-batches round differently in bf16 (observed in earlier DeepSpeed-on-CPU runs: up
# to 4e-3 in the loss between 1 and 2 ranks after 10 steps). Measured for the 2 -> 1 resume below: 4.8e-4.
BF16_TOLERANCE = 5e-3


class Runs:
    """Runs of the driver, each made once per test session and kept: (ranks, stage, bf16, blocks) -> log."""

    def __init__(self, shards, root):
        self.shards, self.root, self.done = shards, root, {}
        self.model_config = no_dropout_config(root / "model.json")

    def ds_config(self, ranks, stage, bf16, name):
        # Written for `ranks`; a resume on another world size reuses the saving run's file on purpose.
        return helpers.write_ds_config(self.root / f"{name}.json", stage=stage, bf16=bf16, micro=MICRO,
                                       gas=GLOBAL_BATCH // (MICRO * ranks), world=ranks, clipping=0.0)

    def run(self, name, ranks, out, ds_config, blocks="tensor", **flags):
        """Losses {global step: all-ranks loss} and the output of one run."""
        log = self.root / f"{name}.log"
        argv = helpers.driver_argv(self.shards, out, ds_config, json_summary=log, config_file=self.model_config,
                                   max_steps=STEPS, log_freq=1, lans_blocks=blocks, learning_rate=0.002, **flags)
        if ranks == 1:
            with contextlib.redirect_stdout(io.StringIO()) as stdout:
                rp.main(argv)
            output = stdout.getvalue()
        else:
            result = helpers.launch(argv, num_ranks=ranks, timeout=600)
            output = result.stdout + result.stderr
            assert result.returncode == 0, output[-4000:]
        losses = {r["step"][1]: r["data"]["all_ranks_average_loss"] for r in helpers.step_records(log)}
        return losses, output

    def uninterrupted(self, ranks, stage, bf16, blocks="tensor", compiled=False):
        key = (ranks, stage, bf16, blocks, compiled)
        if key not in self.done:
            name = f"full_{ranks}_{stage}_{bf16}_{blocks}" + ("_compiled" if compiled else "")
            out = self.root / name
            losses, _ = self.run(name, ranks, out, self.ds_config(ranks, stage, bf16, name), blocks,
                                 num_steps_per_checkpoint=STEPS, enable_torch_compile=compiled)
            assert sorted(losses) == list(range(1, STEPS + 1))
            self.done[key] = (losses, out)
        return self.done[key]

    def resumable(self, ranks, stage, bf16, name):
        """A fresh copy of the output directory of a run stopped (and saved) at step SAVE_AT, and the
        DeepSpeed JSON it ran with."""
        key = ("saved", ranks, stage, bf16)
        if key not in self.done:
            run_name = f"saved_{ranks}_{stage}_{bf16}"
            ds_config = self.ds_config(ranks, stage, bf16, run_name)
            losses, _ = self.run(run_name, ranks, self.root / run_name, ds_config, steps_this_run=SAVE_AT,
                                 num_steps_per_checkpoint=SAVE_AT)
            assert sorted(losses) == list(range(1, SAVE_AT + 1))
            self.done[key] = (self.root / run_name, ds_config)
        saved, ds_config = self.done[key]
        copy = self.root / f"{name}_out"
        shutil.copytree(saved, copy)
        return copy, ds_config


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    return Runs(tiny_shards, tmp_path_factory.mktemp("world_size"))


def max_difference(a: dict, b: dict, steps) -> float:
    return max(abs(a[step] - b[step]) for step in steps)


def test_tensor_blocks_give_the_same_losses_on_any_number_of_ranks(runs):
    one_rank, _ = runs.uninterrupted(1, 0, False)
    zero1, _ = runs.uninterrupted(2, 1, False)
    zero2, _ = runs.uninterrupted(2, 2, False)
    partition, _ = runs.uninterrupted(2, 1, False, blocks="partition")
    all_steps = range(1, STEPS + 1)
    assert max_difference(one_rank, zero1, all_steps) < FP32_TOLERANCE, (one_rank, zero1)
    assert max_difference(one_rank, zero2, all_steps) < FP32_TOLERANCE, (one_rank, zero2)
    # The reference's per-partition blocks are another optimizer on 2 ranks: the test tells them apart.
    assert max_difference(one_rank, partition, all_steps) > 100 * FP32_TOLERANCE, (one_rank, partition)


def test_compile_mode_on_two_ranks_follows_one_eager_rank(runs):
    """Compile mode's LANS update (lans.LANS compile_update) on real ZeRO-1 partitions: per-tensor segments
    cut between 2 ranks, their norms summed over gloo, through the compiled sweeps. Inductor sums in another
    order, yet the fp32 tolerance holds (measured: 1.9e-6)."""
    one_rank, _ = runs.uninterrupted(1, 0, False)
    compiled, _ = runs.uninterrupted(2, 1, False, compiled=True)
    assert max_difference(one_rank, compiled, range(1, STEPS + 1)) < FP32_TOLERANCE, (one_rank, compiled)


# (saving ranks, resuming ranks, ZeRO stage, bf16); the last two only under the marker extra (CI's run has fewer
# ranks, more ranks and bf16 without them).
RESUMES = [pytest.param(a, b, s, h, id=f"{a}to{b}-zero{s}-{'bf16' if h else 'fp32'}",
                        marks=pytest.mark.extra if (a, b, s, h) in ((1, 2, 1, False), (2, 1, 0, False)) else ())
           for a, b, s, h in [(2, 1, 1, False), (1, 2, 1, False), (2, 4, 2, False), (2, 1, 2, True), (2, 1, 0, False)]]


@pytest.mark.parametrize("saver,resumer,stage,bf16", RESUMES)
def test_resume_on_another_world_size_continues_the_uninterrupted_run(runs, saver, resumer, stage, bf16):
    tolerance = BF16_TOLERANCE if bf16 else FP32_TOLERANCE
    # 2 -> 4 is compared with the 2-rank run (tensor blocks make the world size irrelevant, test above).
    reference, reference_out = runs.uninterrupted(min(resumer, 2), stage, bf16)
    name = f"resume_{saver}to{resumer}_{stage}_{bf16}"
    out, ds_config = runs.resumable(saver, stage, bf16, name)
    manifest = checkpointing.read_manifest(out / str(SAVE_AT))[0]
    assert manifest["world_size"] == saver and manifest["optimizer_layout"]["partitioned"] == (stage > 0)

    second, output = runs.run(name, resumer, out, ds_config, resume_from_checkpoint=True,
                              num_steps_per_checkpoint=STEPS)
    assert sorted(second) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max_difference(second, reference, range(SAVE_AT + 1, STEPS + 1)) < tolerance, (second, reference)
    # ZeRO-0 holds whole tensors, which DeepSpeed itself loads on any world size.
    done = "re-partitioned its ZeRO optimizer state" if stage else "per-rank RNG states not restored"
    assert re.search(rf"written by {saver} data-parallel ranks, this run has {resumer}: {done}", output)
    assert f"global batch {GLOBAL_BATCH} = micro-batch {MICRO} x {GLOBAL_BATCH // (MICRO * resumer)} " \
               f"accumulation steps x {resumer} ranks" in output

    # The step counts carried over (LANS's group steps are 20, as in the uninterrupted run), and the
    # consolidated weights of the resumed run's final checkpoint are the uninterrupted run's.
    final = checkpoint_export.saved_optimizer_states(out, str(STEPS))[0]
    if stage:
        final = final["base_optimizer_state"]
    assert [g["step"] for g in final["param_groups"]] == [STEPS, STEPS]
    resumed_weights = checkpoint_export.consolidated_state_dict(out, str(STEPS))
    reference_weights = checkpoint_export.consolidated_state_dict(reference_out, str(STEPS))
    assert resumed_weights.keys() == reference_weights.keys()
    weight_tolerance = 2e-2 if bf16 else 1e-4
    for key, value in resumed_weights.items():
        torch.testing.assert_close(value, reference_weights[key], atol=weight_tolerance, rtol=0, msg=key)


def test_resume_without_the_optimizer_state_is_caught(runs, monkeypatch):
    """Negative control of the test above: with re-partitioning switched off (the optimizer state of
    the saving ranks silently dropped), the resumed losses leave the uninterrupted run's."""
    reference, _ = runs.uninterrupted(1, 1, False)
    out, ds_config = runs.resumable(2, 1, False, "control")
    # The one patch of a private checkpoint function left in the tests, on purpose: the control breaks this step.
    # A public switch to drop the optimizer state would be a flag no run needs, and --init_checkpoint (weights
    # only) also resets the step, schedule and data position, so the losses would part for other reasons too.
    monkeypatch.setattr(checkpoint_resume, "_repartition_optimizer_state", lambda engine, tag_dir: None)
    second, _ = runs.run("control", 1, out, ds_config, resume_from_checkpoint=True, skip_checkpoint=True)
    assert max_difference(second, reference, range(SAVE_AT + 1, STEPS + 1)) > 100 * FP32_TOLERANCE
