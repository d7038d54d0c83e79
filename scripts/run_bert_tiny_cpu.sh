#!/usr/bin/env bash
# The embedded demo (the README's main command): pretrain a tiny BERT on 2 CPU ranks, offline.
#
#   bash scripts/run_bert_tiny_cpu.sh
#
# 1. makes or reuses the virtual environment (.venv, scripts/setup_venv.sh);
# 2. builds phase-1 shards (seq 128, 20 predictions) from the real text in data/sample/ with the full data
#    pipeline (data/create_datasets_from_start.sh sample), once;
# 3. launches 2 ranks through the real `deepspeed` launcher: ZeRO-1, bf16, LANS, PolyWarmUp, gloo;
# 4. checkpoints, prints the reference's final summary and writes $RESULTS_DIR/dllogger.json.
# Environment: RESULTS_DIR (default results/bert_tiny), MAX_STEPS (120), LEARNING_RATE (0.02),
# MASTER_PORT (29500), RESUME=1 to continue from the last checkpoint instead of starting afresh (without it,
# the previous run's $RESULTS_DIR/checkpoints and $RESULTS_DIR/dllogger.json are removed, with a message).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck disable=SC1091
source scripts/setup_venv.sh

RESULTS_DIR="${RESULTS_DIR:-$repo_root/results/bert_tiny}"
MAX_STEPS="${MAX_STEPS:-120}"
LEARNING_RATE="${LEARNING_RATE:-0.02}"
DATA_WORK_DIR="$RESULTS_DIR/data"
DATA_DIR="$DATA_WORK_DIR/hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_dupe_factor_5/books_wiki_en_corpus"
CHECKPOINTS_DIR="$RESULTS_DIR/checkpoints"

echo "== building the phase-1 sample dataset in $DATA_WORK_DIR (reused when complete)"
BERT_PREP_WORKING_DIR="$DATA_WORK_DIR" PHASES=1 PYTHON=python bash data/create_datasets_from_start.sh sample

resume_args=()
if [[ "${RESUME:-0}" == 1 ]]; then
    resume_args=(--resume_from_checkpoint)
elif [[ -e "$CHECKPOINTS_DIR" || -e "$RESULTS_DIR/dllogger.json" ]]; then
    # Only the demo's own outputs; the dataset in $DATA_WORK_DIR is kept and reused.
    echo "== removing the previous demo run in $RESULTS_DIR (checkpoints/, dllogger.json; RESUME=1 continues it instead)"
    rm -rf "$CHECKPOINTS_DIR" "$RESULTS_DIR/dllogger.json"
fi

echo "== training: 2 CPU ranks, ZeRO-1, bf16, LANS, $MAX_STEPS steps"
# Two ranks share the two cores: one thread each (the deepspeed launcher does not set it).
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu
command=(deepspeed --num_gpus 2 --no_local_rank --master_port "${MASTER_PORT:-29500}" run_pretraining.py
         --no_cuda --disable_progress_bar --optimizer lans --use_lr_scheduler
         --config_file scripts/bert_tiny_config.json --deepspeed --deepspeed_config scripts/deepspeed_config_bert_tiny_cpu.json
         --input_dir "$DATA_DIR" --output_dir "$CHECKPOINTS_DIR" --json-summary "$RESULTS_DIR/dllogger.json"
         --max_predictions_per_seq 20 --seed 12439 --learning_rate "$LEARNING_RATE" --warmup_proportion 0.1
         --max_steps "$MAX_STEPS" --num_steps_per_checkpoint 60 --log_freq 10 ${resume_args[@]+"${resume_args[@]}"})
echo "${command[*]}"
"${command[@]}"

python - "$RESULTS_DIR/dllogger.json" <<'PY'
import json, sys
records = [json.loads(line[5:]) for line in open(sys.argv[1]) if line.startswith("DLLL ")]
losses = [r["data"]["average_loss"] for r in records if r["type"] == "LOG" and "average_loss" in r["data"]]
summary = [r["data"] for r in records if r["type"] == "LOG" and r["step"] == []][-1]
print(f"== loss {losses[0]:.3f} (first logged window) -> {losses[-1]:.3f} (last); ln(30522) = 10.326")
print(f"== summary: {json.dumps(summary)}")
print(f"== dllogger: {sys.argv[1]}")
PY
