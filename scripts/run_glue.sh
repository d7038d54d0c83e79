#!/usr/bin/env bash
# Fine-tune and evaluate BERT on a GLUE task with run_glue.py through the DeepSpeed launcher.
#
#   bash scripts/run_glue.sh [extra run_glue.py flags]
#
# Environment (defaults in brackets):
#   TASK_NAME        cola | sst-2 | mrpc | sts-b | qqp | mnli | qnli | rte | wnli       [sst-2]
#   DATA_DIR         the task's TSV directory (train.tsv, dev.tsv, ...)                  [glue/$TASK_NAME]
#   INIT_CHECKPOINT  pretrained weights: run_pretraining.py's checkpoint directory, a checkpointing.py export
#                    file or a Hugging Face directory                                    [results/bert_tiny/checkpoints]
#   CONFIG_FILE      model config (needed only for an export file)                       [none]
#   VOCAB_FILE       [data/vocab.txt]   OUTPUT_DIR [results/glue/$TASK_NAME]   DEEPSPEED_CONFIG [none: fp32, ZeRO-0]
#   NUM_DEVICES [1]  DEVICE cpu | cuda | hpu [cpu]   MASTER_PORT [29500]
#   TRAIN_BATCH_SIZE [32]  LEARNING_RATE [2e-5]  EPOCHS [3]  MAX_SEQ_LENGTH [128]  SEED [2]
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# shellcheck disable=SC1091
source scripts/setup_venv.sh

TASK_NAME="${TASK_NAME:-sst-2}"
DATA_DIR="${DATA_DIR:-glue/$TASK_NAME}"
INIT_CHECKPOINT="${INIT_CHECKPOINT:-results/bert_tiny/checkpoints}"
OUTPUT_DIR="${OUTPUT_DIR:-results/glue/$TASK_NAME}"
DEVICE="${DEVICE:-cpu}"
case "$DEVICE" in
    cpu) device_args=(--no_cuda); export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" ;;
    cuda) device_args=() ;;
    hpu) device_args=(--use_hpu) ;;
    *) echo "error: DEVICE must be cpu, cuda or hpu, not '$DEVICE'" >&2; exit 1 ;;
esac
[[ -d "$DATA_DIR" ]] || { echo "error: DATA_DIR $DATA_DIR does not exist (GLUE's TSV files of $TASK_NAME)" >&2; exit 1; }
[[ -e "$INIT_CHECKPOINT" ]] || { echo "error: INIT_CHECKPOINT $INIT_CHECKPOINT does not exist (run scripts/run_bert_tiny_cpu.sh first)" >&2; exit 1; }

optional_args=()
[[ -n "${CONFIG_FILE:-}" ]] && optional_args+=(--config_file "$CONFIG_FILE")
[[ -n "${DEEPSPEED_CONFIG:-}" ]] && optional_args+=(--deepspeed --deepspeed_config "$DEEPSPEED_CONFIG")
command=(deepspeed --num_gpus "${NUM_DEVICES:-1}" --no_local_rank --master_port "${MASTER_PORT:-29500}" run_glue.py
         "${device_args[@]}" --task_name "$TASK_NAME" --data_dir "$DATA_DIR" --init_checkpoint "$INIT_CHECKPOINT"
         --vocab_file "${VOCAB_FILE:-data/vocab.txt}" --do_lower_case --output_dir "$OUTPUT_DIR"
         --do_train --do_eval --train_batch_size "${TRAIN_BATCH_SIZE:-32}" --learning_rate "${LEARNING_RATE:-2e-5}"
         --num_train_epochs "${EPOCHS:-3}" --max_seq_length "${MAX_SEQ_LENGTH:-128}" --seed "${SEED:-2}"
         --warmup_proportion 0.1 ${optional_args[@]+"${optional_args[@]}"} "$@")
echo "${command[*]}"
"${command[@]}"
