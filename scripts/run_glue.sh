#!/usr/bin/env bash
# Fine-tune and evaluate BERT on a GLUE task with run_glue.py, launched as the other launchers are
# (launch_common.sh: HL_* variables, SIGTERM forwarding, several servers).
#
#   TASK_NAME=mrpc DATA_DIR=glue/MRPC INIT_CHECKPOINT=results/bert_1.5b/checkpoints bash scripts/run_glue.sh [extra run_glue.py flags]
#   HL_DEVICE=cpu HL_NGPU_PER_NODE=1 bash scripts/run_glue.sh      # after the demo, on its checkpoint
#
# Environment (defaults in brackets); relative paths are taken from the repository's root:
#   TASK_NAME        cola | sst-2 | mrpc | sts-b | qqp | mnli | qnli | rte | wnli       [sst-2]
#   DATA_DIR         the task's TSV directory (train.tsv, dev.tsv, ...)                  [glue/$TASK_NAME]
#   INIT_CHECKPOINT  pretrained weights: run_pretraining.py's checkpoint directory, a
#                    `python -m training.checkpointing export`
#                    file or a Hugging Face directory                                    [results/bert_tiny/checkpoints]
#   CONFIG_FILE      model config (needed only for an export file)                       [none]
#   VOCAB_FILE [data/vocab.txt]  TRAIN_BATCH_SIZE [32]  LEARNING_RATE [2e-5]  EPOCHS [3]  MAX_SEQ_LENGTH [128]  SEED [2]
#   and as for the pretraining launchers: HL_RESULTS_DIR [results/glue/$TASK_NAME], HL_DS_CONFIG [none: fp32,
#   ZeRO-0], HL_NUM_NODES [1], HL_NGPU_PER_NODE [8], HL_HOSTSFILE, HL_MASTER_PORT [29500], HL_DEVICE hpu|cuda|cpu [hpu].
# A re-run continues from $HL_RESULTS_DIR/checkpoints (launch_common.sh, check_finetuning_resume).
# The earlier names OUTPUT_DIR, DEEPSPEED_CONFIG, NUM_DEVICES, DEVICE and MASTER_PORT still work (the HL_ name wins).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
cd "$REPO_ROOT"

HL_RESULTS_DIR="${HL_RESULTS_DIR:-${OUTPUT_DIR:-}}" HL_DS_CONFIG="${HL_DS_CONFIG:-${DEEPSPEED_CONFIG:-}}"
HL_NGPU_PER_NODE="${HL_NGPU_PER_NODE:-${NUM_DEVICES:-}}" HL_DEVICE="${HL_DEVICE:-${DEVICE:-}}"
HL_MASTER_PORT="${HL_MASTER_PORT:-${MASTER_PORT:-}}"
TASK_NAME="${TASK_NAME:-sst-2}"
DATA_DIR="${DATA_DIR:-glue/$TASK_NAME}"
INIT_CHECKPOINT="${INIT_CHECKPOINT:-results/bert_tiny/checkpoints}"
DEFAULT_RESULTS_DIR="results/glue/$TASK_NAME"
DEFAULT_DS_CONFIG=""

[[ -d "$DATA_DIR" ]] || die "DATA_DIR $DATA_DIR does not exist (GLUE's TSV files of $TASK_NAME)"
finetuning_settings
optional_args=()
[[ -n "${CONFIG_FILE:-}" ]] && optional_args+=(--config_file "$CONFIG_FILE")
[[ -n "$DS_CONFIG" ]] && optional_args+=(--deepspeed --deepspeed_config "$DS_CONFIG")

launch_finetuning ./run_glue.py --task_name "$TASK_NAME" --data_dir "$DATA_DIR" --init_checkpoint "$INIT_CHECKPOINT" \
    --vocab_file "${VOCAB_FILE:-data/vocab.txt}" --do_lower_case --output_dir "$RESULTS_DIR" --do_train --do_eval \
    --train_batch_size "${TRAIN_BATCH_SIZE:-32}" --learning_rate "${LEARNING_RATE:-2e-5}" \
    --num_train_epochs "${EPOCHS:-3}" --max_seq_length "${MAX_SEQ_LENGTH:-128}" --seed "${SEED:-2}" \
    --warmup_proportion 0.1 "${optional_args[@]}" "$@"
