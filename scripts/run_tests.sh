#!/usr/bin/env bash
# The project's test command: sets up the virtual environment (with test dependencies) and runs pytest.
#   bash scripts/run_tests.sh          default suite (excludes tests marked slow)
#   bash scripts/run_tests.sh --all    the slow tests too, as CI runs it: not the 32-rank rehearsal (marker scale)
#                                      nor the further settings of slow checks (marker extra)
# Other arguments are passed to pytest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
WITH_DEV=1 source scripts/setup_venv.sh

marker=(-m "not slow")
args=()
for arg in "$@"; do
    if [[ "$arg" == "--all" ]]; then marker=(-m "not scale and not extra"); else args+=("$arg"); fi
done
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest "${marker[@]}" ${args[@]+"${args[@]}"}
status=$?
set -e
# pytest exits 5 when no test was collected: that is a failure for us, not a pass.
if [[ $status -eq 5 ]]; then echo "error: no tests were collected" >&2; exit 1; fi
exit $status
