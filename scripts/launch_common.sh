#!/usr/bin/env bash
# Shared by the scripts/run_bert_*.sh launchers (source it; it defines functions and defaults only).
#
# Every path and count can be overridden from the environment with the reference's HL_* variables:
#   HL_DATA_DIR_ROOT     root of the HDF5 datasets        (default /data/pytorch/bert/pretraining)
#   HL_MODEL_CONFIG      model JSON                       HL_DS_CONFIG       DeepSpeed JSON
#   HL_RESULTS_DIR       logs, dllogger.json, TensorBoard HL_CHECKPOINTS_DIR checkpoints
#   HL_NUM_NODES         servers                          HL_NGPU_PER_NODE   devices per server (8)
#   HL_HOSTSFILE         DeepSpeed hostfile for several servers (default scripts/hostsfile)
#   HL_MAX_STEPS HL_RUN_STEPS HL_NUM_STEPS_PER_CP HL_LOG_FREQ  schedule and cadence
#   HL_DEVICE            hpu (default, --use_hpu) | cuda | cpu (--no_cuda)
#   HL_DATA_DIR          the shard directory itself (default: the phase's dataset under HL_DATA_DIR_ROOT)
#   HL_PHASE1_END_STEP   phase-2 launchers: the step of phase 1's last checkpoint in HL_CHECKPOINTS_DIR
# Extra arguments given to a launcher are appended to run_pretraining.py's arguments.
# A launcher sets PHASE=2 for phase 2: seq 512 / 80 predictions, its own schedule and dllogger_phase2.json,
# resuming phase 1's checkpoints directory (phase-2 tags continue after phase 1's last step).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PHASE=1  # set by the launcher after sourcing this file, never taken from the environment
PHASE1_DATASET="hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_dupe_factor_5/books_wiki_en_corpus"
PHASE2_DATASET="hdf5_lower_case_1_seq_len_512_max_pred_80_masked_lm_prob_0.15_random_seed_12345_dupe_factor_5/books_wiki_en_corpus"

die() {
    echo "error: $*" >&2
    exit 1
}

# Phase 1: the reference's schedule and data shape, common to every phase-1 launcher. Phase 2 (the reference
# has no phase-2 launcher): NVIDIA's BERT recipe scaled to our phase 1 (LR 2/3 of phase 1's, warm-up 12.8 %).
phase_args() {
    case "$PHASE" in
        1) PHASE_ARGS=(--max_predictions_per_seq=20 --learning_rate=0.0015 --warmup_proportion=0.05
                       --constant_proportion=0.25 --json-summary="$RESULTS_DIR/dllogger.json") ;;
        2) PHASE_ARGS=(--phase2 --phase1_end_step="$PHASE1_END_STEP" --max_predictions_per_seq=80
                       --learning_rate=0.001 --warmup_proportion=0.128 --constant_proportion=0
                       --json-summary="$RESULTS_DIR/dllogger_phase2.json") ;;
        *) die "PHASE must be 1 or 2, not '${PHASE}'" ;;
    esac
}

# HL_DEVICE (hpu, the default, | cuda | cpu) as the entry points' flags, in DEVICE_ARGS.
device_args() {
    case "${HL_DEVICE:-hpu}" in
        hpu) DEVICE_ARGS=(--use_hpu) ;;
        cuda) DEVICE_ARGS=() ;;
        cpu) DEVICE_ARGS=(--no_cuda) ;;
        *) die "HL_DEVICE must be hpu, cuda or cpu, not '${HL_DEVICE}'" ;;
    esac
}

pretraining_args() {
    device_args
    phase_args
    PRETRAINING_ARGS=(
        "${DEVICE_ARGS[@]}" --disable_progress_bar --optimizer=lans --use_lr_scheduler --resume_from_checkpoint
        --config_file="$MODEL_CONFIG" --output_dir="$CHECKPOINTS_DIR" --seed=12439 --input_dir="$DATA_DIR"
        --max_steps="$MAX_STEPS" --steps_this_run="$RUN_STEPS" --num_steps_per_checkpoint="$NUM_STEPS_PER_CP"
        "${PHASE_ARGS[@]}" --scheduler_degree=1.0 --log_freq="$LOG_FREQ" --deepspeed --deepspeed_config="$DS_CONFIG"
    )
}

# Resolve the HL_* overrides against the launcher's defaults (set before calling this).
resolve_settings() {
    local dataset="$PHASE1_DATASET"
    [[ "$PHASE" == 2 ]] && dataset="$PHASE2_DATASET"
    DATA_DIR="${HL_DATA_DIR:-${HL_DATA_DIR_ROOT:-/data/pytorch/bert/pretraining}/$dataset}"
    MODEL_CONFIG="${HL_MODEL_CONFIG:-$DEFAULT_MODEL_CONFIG}"
    DS_CONFIG="${HL_DS_CONFIG:-$DEFAULT_DS_CONFIG}"
    RESULTS_DIR="${HL_RESULTS_DIR:-$DEFAULT_RESULTS_DIR}"
    CHECKPOINTS_DIR="${HL_CHECKPOINTS_DIR:-$RESULTS_DIR/checkpoints}"
    NUM_NODES="${HL_NUM_NODES:-$DEFAULT_NUM_NODES}"
    NGPU_PER_NODE="${HL_NGPU_PER_NODE:-8}"
    HOSTSFILE="${HL_HOSTSFILE:-$REPO_ROOT/scripts/hostsfile}"
    MAX_STEPS="${HL_MAX_STEPS:-$DEFAULT_MAX_STEPS}"
    RUN_STEPS="${HL_RUN_STEPS:--1}"
    NUM_STEPS_PER_CP="${HL_NUM_STEPS_PER_CP:-$DEFAULT_NUM_STEPS_PER_CP}"
    LOG_FREQ="${HL_LOG_FREQ:-$DEFAULT_LOG_FREQ}"
    PHASE1_END_STEP="${HL_PHASE1_END_STEP:-${DEFAULT_PHASE1_END_STEP:-}}"
    [[ -d "$DATA_DIR" ]] || die "data directory $DATA_DIR does not exist (set HL_DATA_DIR_ROOT or HL_DATA_DIR; build it with data/create_datasets_from_start.sh)"
    [[ -f "$MODEL_CONFIG" ]] || die "model config $MODEL_CONFIG does not exist"
    [[ -f "$DS_CONFIG" ]] || die "DeepSpeed config $DS_CONFIG does not exist"
    if [[ "$PHASE" == 2 && ! -f "$CHECKPOINTS_DIR/latest" ]]; then
        die "phase 2 starts from phase 1's last checkpoint, and $CHECKPOINTS_DIR has none (set HL_CHECKPOINTS_DIR or HL_RESULTS_DIR to phase 1's)"
    fi
    command -v deepspeed > /dev/null || die "the deepspeed launcher is not on PATH (activate the virtual environment)"
}

# Several servers: the hostfile, and the master address from its first host line.
multinode_args() {
    MULTINODE_ARGS=()
    if [[ "$NUM_NODES" != 1 ]]; then
        [[ -f "$HOSTSFILE" ]] || die "$NUM_NODES nodes need a hostfile; $HOSTSFILE does not exist (set HL_HOSTSFILE)"
        local master_addr
        master_addr="$(grep -v '^[[:space:]]*\(#\|$\)' "$HOSTSFILE" | head -n 1 | awk '{print $1}')"
        [[ -n "$master_addr" ]] || die "$HOSTSFILE names no host"
        MULTINODE_ARGS=(--hostfile="$HOSTSFILE" --master_addr "$master_addr")
    fi
}

# deepspeed --num_nodes N --num_gpus 8 --no_local_rank --no_python [multinode] python -u run_pretraining.py ...
launch_pretraining() {
    resolve_settings
    pretraining_args
    multinode_args
    mkdir -p "$RESULTS_DIR"
    cd "$REPO_ROOT"
    local command=(deepspeed --num_nodes "$NUM_NODES" --num_gpus "$NGPU_PER_NODE" --no_local_rank --no_python
                   "${MULTINODE_ARGS[@]}" python -u ./run_pretraining.py "${PRETRAINING_ARGS[@]}" "$@")
    echo "${command[*]}"
    run_forwarding_signals "${command[@]}"
}

# Run the launcher; SIGTERM/SIGINT to this script (e.g. a scheduler signalling only PID 1) are passed on.
# - One node: the deepspeed runner forwards nothing, and deepspeed.launcher.launch answers a signal by
#   terminating the ranks and exiting 1; so the local ranks are signalled directly: they finish their step,
#   save a checkpoint and exit 0, and this script then exits 0.
# - Before the ranks exist (start-up), or with several nodes: the runner and its children are signalled
#   (several nodes: the runner only; its handler stops pdsh and kills the remote launchers). Nothing is
#   saved then and this script exits non-zero (the runner's status, 143 when the signal killed it).
#   Caveat for several nodes: DeepSpeed's per-node launcher SIGKILLs its ranks 30 s after it is itself
#   signalled (launch.py, terminate_process_tree), so a step + save longer than 30 s is cut; to stop a
#   multi-node job cleanly, signal the ranks themselves (on every node), or run one node per job with
#   the single-node launcher script.
# The trap stays armed: a signal that arrives while the ranks start is acted on like the first one.
run_forwarding_signals() {
    trap forward_stop_request TERM INT
    "$@" &
    RUNNER_PID=$!
    local status=0
    wait "$RUNNER_PID" || status=$?
    while kill -0 "$RUNNER_PID" 2> /dev/null; do  # wait returns early when the trap fires
        status=0
        wait "$RUNNER_PID" || status=$?
    done
    exit "$status"
}

forward_stop_request() {
    local runner="${RUNNER_PID:-$!}" launch_pid ranks=()
    [[ -n "$runner" ]] || die "stopped by a signal before the launch"
    if [[ "$NUM_NODES" == 1 ]]; then
        for launch_pid in $(pgrep -P "$runner"); do
            ranks+=($(pgrep -P "$launch_pid"))  # the ranks: children of deepspeed.launcher.launch
        done
    fi
    if (( ${#ranks[@]} > 0 )); then
        kill -TERM "${ranks[@]}" 2> /dev/null || true
    elif [[ "$NUM_NODES" == 1 ]]; then
        kill -TERM $(pgrep -P "$runner") "$runner" 2> /dev/null || true
    else
        kill -TERM "$runner" 2> /dev/null || true
    fi
}
