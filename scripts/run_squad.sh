#!/usr/bin/env bash
# Fine-tune a pretrained checkpoint on SQuAD v1.1 (or v2.0) and evaluate it on the dev set, with NVIDIA's
# run_squad.sh defaults: 2 epochs, 32 sequences of 384 tokens per device, learning rate 4.6e-5, warm-up 0.2,
# seed 1; DeepSpeed ZeRO-1 with bf16 (scripts/deepspeed_config_squad.json).
#
#   python data/squad_download.py                      # once: data/squad/v1.1 and data/squad/v2.0
#   INIT_CHECKPOINT=results/bert_1.5b/checkpoints bash scripts/run_squad.sh [extra run_squad.py flags]
#       (results/bert_1.5b/checkpoints: the output of scripts/run_bert_1.5b_8x.sh)
#   offline, from the CPU demo's checkpoint (scripts/run_bert_tiny_cpu.sh) and data/squad_sample.py's sample:
#   python data/squad_sample.py --output_dir results/squad_sample
#   HL_DEVICE=cpu HL_NGPU_PER_NODE=1 INIT_CHECKPOINT=results/bert_tiny/checkpoints SQUAD_DIR=results/squad_sample/v1.1 \
#       EPOCHS=1 bash scripts/run_squad.sh --max_seq_length 64 --max_query_length 16
#
# Environment: INIT_CHECKPOINT (required: a run_pretraining.py output directory, a
# `python -m training.checkpointing export`
# file or a Hugging Face BERT directory), SQUAD_VERSION (v1.1 | v2.0), SQUAD_DIR (data/squad/$SQUAD_VERSION),
# VOCAB_FILE (data/vocab.txt), TRAIN_BATCH_SIZE (32), LEARNING_RATE (4.6e-5), EPOCHS (2), and as for the
# pretraining launchers HL_RESULTS_DIR (results/squad_$SQUAD_VERSION), HL_DS_CONFIG, HL_NUM_NODES (1),
# HL_NGPU_PER_NODE (8), HL_HOSTSFILE, HL_MASTER_PORT (29500) and HL_DEVICE (hpu | cuda | cpu); relative paths
# are taken from the directory it is started in. SIGTERM/Ctrl-C:
# the ranks save a checkpoint in $HL_RESULTS_DIR/checkpoints; the same command continues from it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

SQUAD_VERSION="${SQUAD_VERSION:-v1.1}"
# relative paths are taken from the caller's directory (the ranks run in the repository's root)
SQUAD_DIR="$(hl_path SQUAD_DIR "$REPO_ROOT/data/squad/$SQUAD_VERSION")"
VOCAB_FILE="$(hl_path VOCAB_FILE "$REPO_ROOT/data/vocab.txt")"
DEFAULT_RESULTS_DIR="$REPO_ROOT/results/squad_$SQUAD_VERSION"
DEFAULT_DS_CONFIG="$REPO_ROOT/scripts/deepspeed_config_squad.json"

case "$SQUAD_VERSION" in
    v1.1) version_args=() ;;
    v2.0) version_args=(--version_2_with_negative) ;;
    *) die "SQUAD_VERSION must be v1.1 or v2.0, not '$SQUAD_VERSION'" ;;
esac
finetuning_settings
for split in train dev; do
    [[ -f "$SQUAD_DIR/$split-$SQUAD_VERSION.json" ]] || die "$SQUAD_DIR/$split-$SQUAD_VERSION.json does not exist (python data/squad_download.py fetches it, python data/squad_sample.py writes an offline sample; set SQUAD_DIR for another place)"
done

launch_finetuning ./run_squad.py --disable-progress-bar --init_checkpoint "$INIT_CHECKPOINT" --vocab_file "$VOCAB_FILE" \
    --do_lower_case --train_file "$SQUAD_DIR/train-$SQUAD_VERSION.json" --predict_file "$SQUAD_DIR/dev-$SQUAD_VERSION.json" \
    --do_train --do_predict --do_eval "${version_args[@]}" --output_dir "$RESULTS_DIR" \
    --json-summary "$RESULTS_DIR/dllogger.json" --train_batch_size "${TRAIN_BATCH_SIZE:-32}" \
    --learning_rate "${LEARNING_RATE:-4.6e-5}" --num_train_epochs "${EPOCHS:-2}" --warmup_proportion 0.2 \
    --max_seq_length 384 --doc_stride 128 --seed 1 --deepspeed --deepspeed_config "$DS_CONFIG" "$@"
