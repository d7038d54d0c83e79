#!/usr/bin/env bash
# Source this file: it creates (once) or reuses the project's virtual environment and activates it.
#   VENV          where the environment lives (default: <repo>/.venv)
#   WITH_DEV=1    also install the test dependencies (requirements-dev.txt)
# torch is installed in the same pip call as deepspeed so that deepspeed's unpinned torch requirement is
# satisfied by the pinned CPU build instead of pulling a CUDA build.
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$repo_root/.venv}"
PYTHON_BIN="${PYTHON_BIN:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "Creating virtual environment in $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV" || { echo "error: could not create a virtual environment with $PYTHON_BIN" >&2; return 1; }
fi
stamp="$VENV/.requirements.sha256"
wanted="$(cat "$repo_root/requirements.txt" ${WITH_DEV:+"$repo_root/requirements-dev.txt"} | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" ]] || ! grep -qx "$wanted" "$stamp"; then
    reqs=(-r "$repo_root/requirements.txt")
    [[ -n "${WITH_DEV:-}" ]] && reqs+=(-r "$repo_root/requirements-dev.txt")
    echo "Installing requirements into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${reqs[@]}" \
        || { echo "error: pip install failed (see above)" >&2; return 1; }
    echo "$wanted" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
