#!/usr/bin/env bash
# BERT-5B phase 1 on 16 servers of 8 devices (ZeRO-2, bf16, LANS, activation checkpointing; 12288 = 24 x 4 x 128). Checkpoint every 120 steps.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

DEFAULT_MODEL_CONFIG="$REPO_ROOT/scripts/bert_5b_config.json"
DEFAULT_DS_CONFIG="$REPO_ROOT/scripts/deepspeed_config_bert_5b.json"
DEFAULT_RESULTS_DIR="$REPO_ROOT/results/bert_5b_lans"
DEFAULT_NUM_NODES=16
DEFAULT_MAX_STEPS=75000
DEFAULT_NUM_STEPS_PER_CP=120
DEFAULT_LOG_FREQ=1
launch_pretraining --checkpoint_activations "$@"
