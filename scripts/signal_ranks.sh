#!/usr/bin/env bash
# On one host: send a signal to the ranks of the pretraining job whose DeepSpeed per-node launcher
# (python -u -m deepspeed.launcher.launch) runs with --master_addr=ADDR --master_port=PORT; the ranks are that
# launcher's children. The launcher itself is not signalled: it would SIGKILL the ranks 30 s later.
# Prints the number of ranks signalled. With --hosts H1,H2,…: the same on each of those hosts over pdsh
# (ssh), printing the total (used by launch_common.sh and training/supervisor.py).
#   bash scripts/signal_ranks.sh [--hosts H1,H2,...] ADDR PORT [SIGNAL (default TERM)]
set -euo pipefail
if [[ "${1:-}" == --hosts ]]; then
    hosts="${2:?usage: signal_ranks.sh --hosts H1,H2,... ADDR PORT [SIGNAL]}"
    shift 2
    PDSH_RCMD_TYPE=ssh pdsh -N -t 10 -u 60 -w "$hosts" bash "$(cd "$(dirname "$0")" && pwd)/signal_ranks.sh" "$@" \
        2> /dev/null | awk '{ n += $1 } END { print n + 0 }'
    exit 0
fi
addr="${1:?usage: signal_ranks.sh ADDR PORT [SIGNAL]}" port="${2:?usage: signal_ranks.sh ADDR PORT [SIGNAL]}"
signal="${3:-TERM}"
pattern="^[^ ]*python[0-9.]* -u -m deepspeed[.]launcher[.]launch .*--master_addr=${addr//./[.]} --master_port=${port}( |$)"
count=0
for launcher in $(pgrep -f "$pattern" || true); do
    for rank in $(pgrep -P "$launcher" || true); do
        kill -"$signal" "$rank" 2> /dev/null && count=$((count + 1))
    done
done
echo "$count"
