#!/usr/bin/env bash
# BERT-1.5B phase 1 on one server of 8 devices (ZeRO-1, bf16, LANS; global batch 12288 = 32 x 48 x 8).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

DEFAULT_MODEL_CONFIG="$REPO_ROOT/scripts/bert_1.5b_config.json"
DEFAULT_DS_CONFIG="$REPO_ROOT/scripts/deepspeed_config_bert_1.5b.json"
DEFAULT_RESULTS_DIR="$REPO_ROOT/results/bert_1.5b"
DEFAULT_NUM_NODES=1
DEFAULT_MAX_STEPS=155000
DEFAULT_NUM_STEPS_PER_CP=200
DEFAULT_LOG_FREQ=10
launch_pretraining  "$@"
