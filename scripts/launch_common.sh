#!/usr/bin/env bash
# Shared by the scripts/run_bert_*.sh, run_squad.sh and run_glue.sh launchers (source it; it defines
# functions and defaults only).
#
# Every path and count can be overridden from the environment with the reference's HL_* variables
# ("the launcher's": the DEFAULT_* value each scripts/run_*.sh sets):
#   HL_DATA_DIR_ROOT     root of the HDF5 datasets        (default /data/pytorch/bert/pretraining)
#   HL_MODEL_CONFIG      model JSON                       HL_DS_CONFIG       DeepSpeed JSON (the launcher's)
#   HL_RESULTS_DIR       logs, dllogger.json (the launcher's)
#   HL_CHECKPOINTS_DIR   checkpoints (default HL_RESULTS_DIR/checkpoints)
#                        (TensorBoard: the DeepSpeed JSON's tensorboard.output_path)
#   HL_NUM_NODES         servers (the launcher's, else 1) HL_NGPU_PER_NODE   devices per server (8)
#   HL_HOSTSFILE         DeepSpeed hostfile for several servers (default scripts/hostsfile)
#   HL_MAX_STEPS         the schedule's length in optimizer steps (the launcher's)
#   HL_RUN_STEPS         optimizer steps of this run (default -1: up to HL_MAX_STEPS)
#   HL_NUM_STEPS_PER_CP HL_LOG_FREQ  checkpoint and log cadence in optimizer steps (the launcher's)
#   HL_MASTER_PORT       the rendezvous port (default 29500)
#   HL_PREFLIGHT         0 skips training/preflight.py (default 1: it runs)
#   HL_DEVICE            hpu (default, --use_hpu) | cuda | cpu (--no_cuda); for hpu, PT_HPU_LAZY_MODE picks
#                        Habana's mode: 1 (default) lazy, 0 compile (see hpu_environment)
#   HL_DATA_DIR          the shard directory itself (default: the phase's dataset under HL_DATA_DIR_ROOT)
#   HL_PHASE1_END_STEP   phase-2 launchers: the step of phase 1's last checkpoint in HL_CHECKPOINTS_DIR
#                        (the launcher's)
#   HL_MAX_RESTARTS HL_RESTART_WINDOW_S HL_MIN_HOSTS  several servers: training/supervisor.py restarts a failed job on
#                        the servers that pass the checks, at most HL_MAX_RESTARTS (3; 0: never) times within
#                        HL_RESTART_WINDOW_S seconds (21600), on at least HL_MIN_HOSTS (half the servers)
# A relative HL_* path is taken from the directory the launcher is started in (run_glue.sh moves to the
# repository's root first, as its header says), and made absolute before it is checked or used.
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
        1) JSON_SUMMARY="$RESULTS_DIR/dllogger.json"
           PHASE_ARGS=(--max_predictions_per_seq=20 --learning_rate=0.0015 --warmup_proportion=0.05
                       --constant_proportion=0.25) ;;
        2) JSON_SUMMARY="$RESULTS_DIR/dllogger_phase2.json"
           PHASE_ARGS=(--phase2 --phase1_end_step="$PHASE1_END_STEP" --max_predictions_per_seq=80
                       --learning_rate=0.001 --warmup_proportion=0.128 --constant_proportion=0) ;;
        *) die "PHASE must be 1 or 2, not '${PHASE}'" ;;
    esac
    PHASE_ARGS+=(--json-summary="$JSON_SUMMARY")
}

# The deepspeed runner's options of every launch (the demo's too): no INFO lines. Among them were the runner's
# command and each rank's, every one with the rank's whole command line, which the launcher prints once itself,
# and on a CPU run 'Setting CUDA_VISIBLE_DEVICES=0,1', which says nothing true. Warnings and errors still show.
LAUNCHER_ARGS=(--log_level=warning)

# HL_DEVICE (hpu, the default, | cuda | cpu) as the entry points' flags, in DEVICE_ARGS, once check_devices
# found the device here, the ranks' environment in RANK_ENV (hpu_environment), and the devices the ranks get
# in RESOURCE_ARGS (resource_args). CPU ranks take DeepSpeed's CPU accelerator and one thread each unless told
# otherwise.
device_args() {
    RANK_ENV=()
    case "${HL_DEVICE:-hpu}" in
        hpu) DEVICE_ARGS=(--use_hpu); hpu_environment ;;
        cuda) DEVICE_ARGS=() ;;
        cpu) DEVICE_ARGS=(--no_cuda)
             export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" ;;
        *) die "HL_DEVICE must be hpu, cuda or cpu, not '${HL_DEVICE}'" ;;
    esac
    check_devices
    resource_args
}

# Before any rank starts: this machine has HL_NGPU_PER_NODE devices of the kind HL_DEVICE names (otherwise
# every rank would fail with its own traceback). With several servers this one stands for the others.
check_devices() {
    [[ "$NGPU_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "HL_NGPU_PER_NODE must be a number of devices (1 or more), not '$NGPU_PER_NODE'"
    [[ "${HL_DEVICE:-hpu}" == cpu ]] && return 0
    "$PYTHON" - "${HL_DEVICE:-hpu}" "$NGPU_PER_NODE" <<'PY' || exit 1
import sys
device, wanted = sys.argv[1], int(sys.argv[2])
try:
    if device == "hpu":
        import habana_frameworks.torch.hpu as accelerator
    else:
        import torch
        accelerator = torch.cuda
    found = accelerator.device_count() if accelerator.is_available() else 0
except ImportError:
    found = 0
kind = {"hpu": "Gaudi", "cuda": "CUDA"}[device]
if found == 0:
    sys.exit(f"error: HL_DEVICE={device}{' (the default)' if device == 'hpu' else ''} but this machine has no {kind}"
             " device: set HL_DEVICE=cpu (or cuda, hpu) and HL_NGPU_PER_NODE to the number of ranks")
if wanted > found:
    sys.exit(f"error: HL_NGPU_PER_NODE={wanted} but this machine has {found} {kind} devices: set HL_NGPU_PER_NODE={found} or fewer")
PY
}

# Habana's execution mode and the reference's environment for it, each variable only where the user has not
# set it (a user's value is passed on as it is). RANK_ENV is an `env` prefix of the ranks' command, so that
# the settings reach every server: the deepspeed runner passes on only a few variables of its own.
#   PT_HPU_LAZY_MODE=1 (default): lazy mode, as the reference up to 1.16 (we follow 1.9.0); the driver cuts
#     the graph with mark_step (training/gaudi.py). With the 5B config (the reference's test: the config file's name)
#     also 1.9.0's memory settings PT_HPU_POOL_MEM_ACQUIRE_PERC=100, ENABLE_EXPERIMENTAL_FLAGS=true and
#     DISABLE_TENSOR_SIZE_VALIDATION=true.
#   PT_HPU_LAZY_MODE=0: compile mode, as the reference from 1.17 on: --enable_torch_compile, nothing else.
# The bridge reads these when it is first imported, so they must be set before python starts.
hpu_environment() {
    local lazy_mode="${PT_HPU_LAZY_MODE:-1}"
    RANK_ENV=(env "PT_HPU_LAZY_MODE=$lazy_mode")
    case "$lazy_mode" in
        1) if [[ "${MODEL_CONFIG:-}" == *bert_5b_config.json* ]]; then
               RANK_ENV+=("PT_HPU_POOL_MEM_ACQUIRE_PERC=${PT_HPU_POOL_MEM_ACQUIRE_PERC:-100}"
                          "ENABLE_EXPERIMENTAL_FLAGS=${ENABLE_EXPERIMENTAL_FLAGS:-true}"
                          "DISABLE_TENSOR_SIZE_VALIDATION=${DISABLE_TENSOR_SIZE_VALIDATION:-true}")
           fi ;;
        0) DEVICE_ARGS+=(--enable_torch_compile) ;;
        *) die "PT_HPU_LAZY_MODE must be 1 (lazy mode) or 0 (compile mode), not '$lazy_mode'" ;;
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

# hl_path NAME DEFAULT: the path in the variable NAME (an HL_* one, or a fine-tuning launcher's), made absolute against the current directory (the
# launchers check it here and use it after `cd "$REPO_ROOT"`), or DEFAULT when NAME is unset or empty.
hl_path() {
    local value="${!1:-}"
    if [[ -z "$value" ]]; then
        printf '%s\n' "$2"
    elif [[ "$value" == /* ]]; then
        printf '%s\n' "$value"
    else
        realpath -m -s -- "$value"
    fi
}

# Every launcher's HL_* overrides against its DEFAULT_* values (DEFAULT_NUM_NODES: 1 when unset).
common_settings() {
    RESULTS_DIR="$(hl_path HL_RESULTS_DIR "$DEFAULT_RESULTS_DIR")"
    DS_CONFIG="$(hl_path HL_DS_CONFIG "$DEFAULT_DS_CONFIG")"
    NUM_NODES="${HL_NUM_NODES:-${DEFAULT_NUM_NODES:-1}}"
    [[ "$NUM_NODES" =~ ^[1-9][0-9]*$ ]] || die "HL_NUM_NODES must be a number of servers (1 or more), not '$NUM_NODES'"
    NGPU_PER_NODE="${HL_NGPU_PER_NODE:-8}"
    HOSTSFILE="$(hl_path HL_HOSTSFILE "$REPO_ROOT/scripts/hostsfile")"
}

# Resolve the HL_* overrides against the launcher's defaults (set before calling this).
resolve_settings() {
    local dataset="$PHASE1_DATASET"
    [[ "$PHASE" == 2 ]] && dataset="$PHASE2_DATASET"
    DATA_DIR="$(hl_path HL_DATA_DIR "$(hl_path HL_DATA_DIR_ROOT /data/pytorch/bert/pretraining)/$dataset")"
    MODEL_CONFIG="$(hl_path HL_MODEL_CONFIG "$DEFAULT_MODEL_CONFIG")"
    common_settings
    CHECKPOINTS_DIR="$(hl_path HL_CHECKPOINTS_DIR "$RESULTS_DIR/checkpoints")"
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
    find_launcher_and_python
}

# The deepspeed launcher, and in PYTHON the interpreter the ranks run, by its absolute path: on another
# server, ssh's PATH finds the system python, not the virtual environment (same paths on every server are
# required anyway).
find_launcher_and_python() {
    command -v deepspeed > /dev/null || die "the deepspeed launcher is not on PATH (activate the virtual environment)"
    PYTHON="$(command -v python)" || die "python is not on PATH (activate the virtual environment)"
}

# The rendezvous: the master port, and with several servers the hostfile, the master address (its first host)
# and the job's hosts (the first NUM_NODES host lines, as `deepspeed --num_nodes` takes them).
rendezvous_args() {
    JOB_HOSTS=""
    MASTER_PORT="${HL_MASTER_PORT:-29500}"
    RENDEZVOUS_ARGS=(--master_port "$MASTER_PORT")
    if (( NUM_NODES > 1 )); then
        [[ -f "$HOSTSFILE" ]] || die "$NUM_NODES nodes need a hostfile; $HOSTSFILE does not exist (set HL_HOSTSFILE)"
        JOB_HOSTS="$(grep -v '^[[:space:]]*\(#\|$\)' "$HOSTSFILE" | head -n "$NUM_NODES" | awk '{print $1}' | paste -sd, -)"
        [[ -n "$JOB_HOSTS" ]] || die "$HOSTSFILE names no host"
        RENDEZVOUS_ARGS=(--hostfile="$HOSTSFILE" --master_addr "${JOB_HOSTS%%,*}" --master_port "$MASTER_PORT")
    fi
}

# training/preflight.py: hostfile, every host over ssh, versions, data directory, batch arithmetic (HL_PREFLIGHT=0
# skips). It runs in the repository, as the ranks do (relative paths mean the same to both).
run_preflight() {
    [[ "${HL_PREFLIGHT:-1}" == 0 ]] && return 0
    (cd "$REPO_ROOT" && "$PYTHON" -m training.preflight --deepspeed_config "$DS_CONFIG" --data_dir "$DATA_DIR" \
        --num_nodes "$NUM_NODES" --ngpu_per_node "$NGPU_PER_NODE" --hostfile "$HOSTSFILE") || exit 1
}

# One node: launch_ranks. Several: training/supervisor.py runs each attempt with --num_nodes, --hostfile, --master_addr
# and --master_port after `deepspeed`, prints its command, passes SIGTERM/SIGINT on, and restarts on the hosts
# that remain.
launch_pretraining() {
    resolve_settings
    pretraining_args
    rendezvous_args
    run_preflight
    if (( NUM_NODES > 1 )); then
        mkdir -p "$RESULTS_DIR"
        cd "$REPO_ROOT" || exit 1
        exec "$PYTHON" -m training.supervisor --hostfile "$HOSTSFILE" --num_nodes "$NUM_NODES" \
            --ngpu_per_node "$NGPU_PER_NODE" --master_port "$MASTER_PORT" --deepspeed_config "$DS_CONFIG" \
            --data_dir "$DATA_DIR" --json_summary "$JSON_SUMMARY" --max_restarts "${HL_MAX_RESTARTS:-3}" \
            --restart_window_s "${HL_RESTART_WINDOW_S:-21600}" --min_hosts "${HL_MIN_HOSTS:-$(( (NUM_NODES + 1) / 2 ))}" \
            -- deepspeed "${LAUNCHER_ARGS[@]}" --num_gpus "$NGPU_PER_NODE" --no_local_rank --no_python \
            "${RANK_ENV[@]}" "$PYTHON" -u ./run_pretraining.py "${PRETRAINING_ARGS[@]}" "$@"
    fi
    launch_ranks ./run_pretraining.py "${PRETRAINING_ARGS[@]}" "$@"
}

# The fine-tuning launchers' settings (set DEFAULT_RESULTS_DIR and DEFAULT_DS_CONFIG first; an empty one: the
# entry point's own DeepSpeed settings) and their checks of INIT_CHECKPOINT and the DeepSpeed JSON.
finetuning_settings() {
    common_settings
    INIT_CHECKPOINT="$(hl_path INIT_CHECKPOINT "")"
    [[ -n "${INIT_CHECKPOINT:-}" ]] || die "set INIT_CHECKPOINT to the pretrained weights (a run_pretraining.py output directory, an export file or a Hugging Face directory)"
    [[ -e "$INIT_CHECKPOINT" ]] || die "INIT_CHECKPOINT $INIT_CHECKPOINT does not exist"
    [[ -z "$DS_CONFIG" || -f "$DS_CONFIG" ]] || die "DeepSpeed config $DS_CONFIG does not exist"
}

# launch_finetuning ./run_x.py ARGS...: the ranks run the script with HL_DEVICE's flags, then ARGS.
launch_finetuning() {
    local script="$1"
    shift
    find_launcher_and_python
    device_args
    rendezvous_args
    check_finetuning_resume
    launch_ranks "$script" "${DEVICE_ARGS[@]}" --resume_from_checkpoint "$@"
}

# Every launcher resumes when its checkpoints directory holds checkpoints, and starts afresh otherwise. A
# fine-tuning run continues after a stop, and evaluates again after a finished run. Checkpoints fine-tuned
# from other weights (RESULTS_DIR/init_checkpoint names them) stop the launch: resuming them would report
# their result as this INIT_CHECKPOINT's.
check_finetuning_resume() {
    local checkpoints="$RESULTS_DIR/checkpoints" record="$RESULTS_DIR/init_checkpoint" init
    init="$(realpath -m "$INIT_CHECKPOINT")"
    if [[ -n "$(ls -A "$checkpoints" 2> /dev/null)" ]]; then
        if [[ -f "$record" && "$(cat "$record")" != "$init" ]]; then
            die "$checkpoints holds a fine-tuning of $(cat "$record"), not of INIT_CHECKPOINT $init: set HL_RESULTS_DIR to a new directory (or remove that one)"
        fi
        echo "== resuming from $checkpoints (a new HL_RESULTS_DIR starts afresh)"
    fi
    mkdir -p "$RESULTS_DIR"
    echo "$init" > "$record"
}

# Which devices of each server the ranks get, as deepspeed runner arguments, in RESOURCE_ARGS:
# `--num_nodes N --num_gpus G`, devices 0..G-1. Trap: given --num_gpus, the runner of DeepSpeed 0.19.8
# (launcher/runner.py, main) ignores and deletes CUDA_VISIBLE_DEVICES, and launch.py gives the ranks devices
# 0..G-1, which may be another job's. So on one server with HL_DEVICE=cuda and CUDA_VISIBLE_DEVICES set (by
# the user, or a scheduler such as Slurm), its first G devices are named with `--include localhost:IDS` (which
# excludes --num_nodes/--num_gpus). The runner takes only numeric indices there: other forms (GPU-/MIG- UUIDs)
# are an error. With several servers every server's ranks get devices 0..G-1 (CUDA_VISIBLE_DEVICES is not
# passed to the other servers). RUNNER_ENV, the `env` prefix of the runner: with --include the runner starts
# without CUDA_VISIBLE_DEVICES (launch.py sets it to the --include list for the ranks), or it would print that
# it ignores the variable.
resource_args() {
    RESOURCE_ARGS=(--num_nodes "$NUM_NODES" --num_gpus "$NGPU_PER_NODE")
    RUNNER_ENV=()
    [[ "${HL_DEVICE:-hpu}" == cuda && -n "${CUDA_VISIBLE_DEVICES:-}" ]] && (( NUM_NODES == 1 )) || return 0
    local ids id
    IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
    ids=("${ids[@]:0:$NGPU_PER_NODE}")
    for id in "${ids[@]}"; do
        [[ "$id" =~ ^[0-9]+$ ]] || die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: the deepspeed launcher takes devices by index only (e.g. 4,5,6,7), not '$id'"
    done
    RESOURCE_ARGS=(--include "localhost:$(IFS=,; echo "${ids[*]}")")
    RUNNER_ENV=(env -u CUDA_VISIBLE_DEVICES)
}

# [env -u VAR] deepspeed RESOURCES --no_local_rank --no_python RENDEZVOUS [env VAR=value...] /abs/python -u SCRIPT ARGS...
# (RESOURCES and the first env: resource_args, run by device_args)
launch_ranks() {
    mkdir -p "$RESULTS_DIR"
    cd "$REPO_ROOT" || exit 1
    local command=("${RUNNER_ENV[@]}" deepspeed "${LAUNCHER_ARGS[@]}" "${RESOURCE_ARGS[@]}" --no_local_rank --no_python
                   "${RENDEZVOUS_ARGS[@]}" "${RANK_ENV[@]}" "$PYTHON" -u "$@")
    echo "${command[*]}"
    run_forwarding_signals "${command[@]}"
}

# Run the launcher; SIGTERM/SIGINT to this script (e.g. a scheduler signalling only PID 1) are passed on to
# the ranks, which finish their step, save a checkpoint and exit 3 (stopped: training/run_status.py). Returns
# the runner's status (3 then).
# - One node: the local ranks (children of deepspeed.launcher.launch) are signalled directly. The deepspeed
#   runner forwards nothing itself, and deepspeed.launcher.launch answers a signal by terminating the ranks
#   and exiting 1.
# - Several nodes: the ranks on every host are signalled over pdsh/ssh (scripts/signal_ranks.sh). Neither
#   the runner nor pdsh is signalled: the runner's handler would kill pdsh and signal the per-node
#   launchers, which SIGKILL their ranks 30 s later (launch.py, terminate_process_tree), cutting a long
#   step or save, and the ranks' output would go to a closed ssh connection.
# - Before any rank exists (start-up): the runner and its children are signalled; nothing is saved and this
#   status is non-zero (the runner's, 143 when the signal killed it).
# The trap stays armed until the runner ends: a signal that arrives while the ranks start is acted on like
# the first one.
# The runner runs in a session of its own (setsid), as the supervisor's attempts do: a Ctrl-C at the terminal
# (SIGINT to the whole foreground process group) or any signal to this script's process group reaches this
# script alone, and takes the path above. Shared with the runner, it reached deepspeed.launcher.launch too,
# which killed the ranks (SIGKILL after 30 s, cutting a long save) and exited 1. A hangup (the terminal closed)
# is passed on to the runner's session, which it ended before as it ended this script; a SIGKILL to this
# script's process group does not reach the ranks (`kill -KILL -- -PGID` of the runner's PID does).
# The runner's stdout passes through runner_output_filter.
run_forwarding_signals() {
    local filter status=0
    # The filter ignores SIGINT and SIGTERM (a Ctrl-C reaches it too): it ends when the job's output does.
    exec {filter}> >(trap '' INT TERM; runner_output_filter)
    FILTER_PID=$!
    trap forward_stop_request TERM INT
    trap 'kill -HUP -- "-${RUNNER_PID:-}" 2> /dev/null; exit 129' HUP
    setsid "$@" >&"$filter" &
    RUNNER_PID=$!
    exec {filter}>&-  # the runner holds the pipe now: the filter's input ends with the job
    wait "$RUNNER_PID" || status=$?
    while kill -0 "$RUNNER_PID" 2> /dev/null; do  # wait returns early when the trap fires
        status=0
        wait "$RUNNER_PID" || status=$?
    done
    trap - TERM INT HUP
    wait "$FILTER_PID" || true  # its last lines come before anything this script prints next
    return "$status"
}

# The runner's output with the line in which deepspeed.launcher.launch reports a rank's non-zero exit (its
# sigkill_handler: `[ERROR] [launch.py:259:sigkill_handler] [<the rank's whole command line>] exits with
# return code = N`) taken out, so that the user's last line is ours. A rank that exited with status 1, 2 or 3
# (training/run_status.py) has said why itself (our `error:` or stop line, a traceback, argparse's usage); any other
# status, a signal's among them (-9: SIGKILL, as the kernel's out-of-memory killer sends it), becomes one short
# `error:` line on stderr. Line by line, unbuffered; bytes pass as they are (LC_ALL=C).
runner_output_filter() {
    LC_ALL=C sed -u -E \
        -e '/\[launch\.py:[0-9]+:sigkill_handler\] .* exits with return code = -?[0-9]+$/!b' \
        -e '/ = [123]$/d' \
        -e "s/.* = -([0-9]+)\$/error: a rank was killed by signal \\1 (DeepSpeed's launcher)/" \
        -e "s/.* = ([0-9]+)\$/error: a rank exited with status \\1 (DeepSpeed's launcher)/" \
        -e 'w /dev/stderr' -e d
}

forward_stop_request() {
    # No `return` in here: in a trap handler it returns the interrupted `wait`'s status, and set -e exits.
    local runner="${RUNNER_PID:-$!}" launch_pid ranks=()
    [[ -n "$runner" && "$runner" != "${FILTER_PID:-}" ]] || die "stopped by a signal before the launch"
    if (( NUM_NODES > 1 )); then
        if (( $(signal_ranks_on_every_host) == 0 )); then
            kill -TERM "$runner" 2> /dev/null || true
        fi
    else
        for launch_pid in $(pgrep -P "$runner"); do
            # The ranks: children of deepspeed.launcher.launch. Read through mapfile: pgrep's status 1 (no rank
            # yet, while the launcher starts them) must not end this handler under set -e.
            mapfile -t -O "${#ranks[@]}" ranks < <(pgrep -P "$launch_pid")
        done
        if (( ${#ranks[@]} > 0 )); then
            kill -TERM "${ranks[@]}" 2> /dev/null || true
        else
            kill -TERM $(pgrep -P "$runner") "$runner" 2> /dev/null || true
        fi
    fi
}

# SIGTERM to this job's ranks on every host (found by their per-node launcher's --master_addr/--master_port);
# prints how many were signalled in all.
signal_ranks_on_every_host() {
    bash "$REPO_ROOT/scripts/signal_ranks.sh" --hosts "$JOB_HOSTS" "${JOB_HOSTS%%,*}" "$MASTER_PORT" TERM
}
