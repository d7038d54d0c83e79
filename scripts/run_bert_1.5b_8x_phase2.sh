#!/usr/bin/env bash
# BERT-1.5B phase 2 on one server of 8 devices, after run_bert_1.5b_8x.sh (or _32x with HL_RESULTS_DIR):
# seq 512 / 80 predictions, ZeRO-1, bf16, LANS; global batch 4096 = 8 x 64 x 8. It resumes phase 1's last
# checkpoint (HL_PHASE1_END_STEP, default 155000) from the same checkpoints directory, keeps the optimizer
# moments, restarts the step counter and the schedule, and logs to dllogger_phase2.json. Phase 2 sees 1/9
# of phase 1's sequences, as in NVIDIA's BERT recipe (51 M after 461 M): 155000 x 12288 / 9 / 4096 steps.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

PHASE=2
DEFAULT_MODEL_CONFIG="$REPO_ROOT/scripts/bert_1.5b_config.json"
DEFAULT_DS_CONFIG="$REPO_ROOT/scripts/deepspeed_config_bert_1.5b_phase2.json"
DEFAULT_RESULTS_DIR="$REPO_ROOT/results/bert_1.5b"
DEFAULT_NUM_NODES=1
DEFAULT_MAX_STEPS=51667
DEFAULT_PHASE1_END_STEP=155000
DEFAULT_NUM_STEPS_PER_CP=200
DEFAULT_LOG_FREQ=10
launch_pretraining  "$@"
