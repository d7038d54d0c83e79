#!/usr/bin/env bash
# The embedded demo (the README's main command): pretrain a tiny BERT on 2 CPU ranks, offline.
#
#   bash scripts/run_bert_tiny_cpu.sh             phase 1: seq 128, 20 predictions, 120 steps
#   PHASE=2 bash scripts/run_bert_tiny_cpu.sh     then phase 2: seq 512, 80 predictions, 40 steps
#
# 1. makes or reuses the virtual environment (.venv, scripts/setup_venv.sh);
# 2. builds the phase's shards from the real text in data/sample/ with the full data pipeline
#    (data/create_datasets_from_start.sh sample), once;
# 3. launches 2 ranks through the real `deepspeed` launcher: ZeRO-1, bf16, LANS, PolyWarmUp, gloo;
# 4. checkpoints, prints the reference's final summary, writes the dllogger JSON, TensorBoard events and
#    a PNG of the loss and learning-rate curves (scripts/plot_dllogger.py).
# Phase 1 writes to $RESULTS_DIR; phase 2 to $RESULTS_DIR/phase2, starting from a copy of phase 1's last
# checkpoint (optimizer moments kept, step counter and LR schedule restarted), so phase 1's outputs stay.
# Environment: RESULTS_DIR (default results/bert_tiny), PHASE (1), MAX_STEPS (120 in phase 1, 40 in
# phase 2), LEARNING_RATE (0.02), MASTER_PORT (29500). As every launcher, a re-run continues the phase from
# its last checkpoint (its dllogger JSON is appended to; a larger MAX_STEPS extends the run); another
# RESULTS_DIR, or removing the phase's checkpoints/, starts afresh.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck disable=SC1091
source scripts/setup_venv.sh
phase_requested="${PHASE:-1}"
# shellcheck source=scripts/launch_common.sh
source scripts/launch_common.sh  # LAUNCHER_ARGS, run_forwarding_signals; it sets PHASE=1, which the demo takes from the environment
NUM_NODES=1

RESULTS_DIR="${RESULTS_DIR:-$repo_root/results/bert_tiny}"
PHASE="$phase_requested"
LEARNING_RATE="${LEARNING_RATE:-0.02}"
DATA_WORK_DIR="$RESULTS_DIR/data"
case "$PHASE" in
    1) seq_len=128 max_pred=20 default_steps=120 run_dir="$RESULTS_DIR" ;;
    2) seq_len=512 max_pred=80 default_steps=40 run_dir="$RESULTS_DIR/phase2" ;;
    *) echo "error: PHASE must be 1 or 2, not '$PHASE'" >&2; exit 2 ;;
esac
MAX_STEPS="${MAX_STEPS:-$default_steps}"
[[ "$MAX_STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "error: MAX_STEPS must be a whole number of steps above 0, not '$MAX_STEPS'" >&2; exit 2; }
# The loss is logged every 10 steps, or at the last step of a shorter run: the plot needs at least one record.
log_freq=$(( MAX_STEPS < 10 ? MAX_STEPS : 10 ))
DATA_DIR="$DATA_WORK_DIR/hdf5_lower_case_1_seq_len_${seq_len}_max_pred_${max_pred}_masked_lm_prob_0.15_random_seed_12345_dupe_factor_5/books_wiki_en_corpus"
CHECKPOINTS_DIR="$run_dir/checkpoints"
JSON_SUMMARY="$run_dir/dllogger.json"
PHASE1_CHECKPOINTS_DIR="$RESULTS_DIR/checkpoints"
PHASE1_END_STEP_FILE="$run_dir/phase1_end_step"

echo "== building the phase-$PHASE sample dataset in $DATA_WORK_DIR (reused when complete)"
BERT_PREP_WORKING_DIR="$DATA_WORK_DIR" PHASES="$PHASE" PYTHON=python bash data/create_datasets_from_start.sh sample

run_args=(--resume_from_checkpoint)
if [[ -f "$CHECKPOINTS_DIR/latest" ]]; then
    echo "== resuming phase $PHASE from its checkpoint $(cat "$CHECKPOINTS_DIR/latest") in $CHECKPOINTS_DIR (appending to $JSON_SUMMARY; another RESULTS_DIR starts afresh)"
else
    if [[ "$PHASE" == 1 ]]; then
        run_args=()
    else
        [[ -f "$PHASE1_CHECKPOINTS_DIR/latest" ]] || {
            echo "error: phase 2 starts from phase 1's last checkpoint, and $PHASE1_CHECKPOINTS_DIR has none: run phase 1 first (bash scripts/run_bert_tiny_cpu.sh)" >&2
            exit 1
        }
        phase1_end_step="$(cat "$PHASE1_CHECKPOINTS_DIR/latest")"
        echo "== phase 2 starts from a copy of phase 1's checkpoint $phase1_end_step"
        mkdir -p "$CHECKPOINTS_DIR"
        cp -r "$PHASE1_CHECKPOINTS_DIR/$phase1_end_step" "$PHASE1_CHECKPOINTS_DIR/latest" "$CHECKPOINTS_DIR/"
        echo "$phase1_end_step" > "$PHASE1_END_STEP_FILE"
    fi
fi
if [[ "$PHASE" == 2 ]]; then
    [[ -f "$PHASE1_END_STEP_FILE" ]] || { echo "error: $CHECKPOINTS_DIR holds checkpoints but $PHASE1_END_STEP_FILE is missing: remove $CHECKPOINTS_DIR to start phase 2 afresh" >&2; exit 1; }
    run_args+=(--phase2 --phase1_end_step "$(cat "$PHASE1_END_STEP_FILE")")
fi

# The DeepSpeed JSON with TensorBoard's events under $run_dir (the file's own path assumes the default RESULTS_DIR).
mkdir -p "$run_dir"
ds_config="$run_dir/deepspeed_config.json"
python - "scripts/deepspeed_config_bert_tiny_cpu$([[ "$PHASE" == 2 ]] && echo _phase2).json" "$run_dir/tensorboard" > "$ds_config" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["tensorboard"]["output_path"] = sys.argv[2]
print(json.dumps(config, indent=1))
PY

echo "== training phase $PHASE: 2 CPU ranks, ZeRO-1, bf16, LANS, $MAX_STEPS steps"
# Two ranks share the two cores: one thread each (the deepspeed launcher does not set it).
# Unbuffered output: each rank writes its lines as they come, so two ranks sharing the terminal cannot cut
# into the middle of each other's buffered blocks (as "python -u" does in the launchers).
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
command=(deepspeed "${LAUNCHER_ARGS[@]}" --num_gpus 2 --no_local_rank --master_port "${MASTER_PORT:-29500}" run_pretraining.py
         --no_cuda --disable_progress_bar --optimizer lans --use_lr_scheduler
         --config_file scripts/bert_tiny_config.json --deepspeed --deepspeed_config "$ds_config"
         --input_dir "$DATA_DIR" --output_dir "$CHECKPOINTS_DIR" --json-summary "$JSON_SUMMARY"
         --max_predictions_per_seq "$max_pred" --seed 12439 --learning_rate "$LEARNING_RATE" --warmup_proportion 0.1
         --max_steps "$MAX_STEPS" --num_steps_per_checkpoint 60 --log_freq "$log_freq" ${run_args[@]+"${run_args[@]}"})
echo "${command[*]}"
# SIGTERM or Ctrl-C: the ranks save a checkpoint and exit 3 (stopped, training/run_status.py); the summary of
# what was trained is still printed, then the script exits 3.
status=0
run_forwarding_signals "${command[@]}" || status=$?
(( status == 0 || status == 3 )) || exit "$status"

python - "$JSON_SUMMARY" <<'PY'
import json, math, sys
records = [json.loads(line[5:]) for line in open(sys.argv[1]) if line.startswith("DLLL ")]
losses = [r["data"]["average_loss"] for r in records if r["type"] == "LOG" and "average_loss" in r["data"]]
summary = [r["data"] for r in records if r["type"] == "LOG" and r["step"] == []][-1]
if losses:
    # The loss is MLM + next sentence: a uniform guess scores ln(vocabulary) + ln(2), where training starts.
    print(f"== loss {losses[0]:.3f} (first logged window) -> {losses[-1]:.3f} (last); uniform guess: "
          f"ln(30522) + ln(2) = {math.log(30522) + math.log(2):.3f}")
print(f"== summary: {json.dumps(summary)}")
print(f"== dllogger: {sys.argv[1]}")
PY
python scripts/plot_dllogger.py "$JSON_SUMMARY" -o "$run_dir/loss.png"
echo "== TensorBoard: tensorboard --logdir $run_dir/tensorboard"
exit "$status"
