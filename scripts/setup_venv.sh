#!/usr/bin/env bash
# Source this file: it creates (once) or reuses the project's virtual environment and activates it.
#   VENV          where the environment lives (default: <repo>/.venv)
#   WITH_DEV=1    also install the test dependencies (requirements-dev.txt)
#   PYTHON_BIN    the interpreter that creates the environment (default: python3)
# It also installs the project itself in editable mode (pip install -e ., see pyproject.toml).
# torch is installed in the same pip call as deepspeed so that deepspeed's unpinned torch requirement is
# satisfied by the pinned torch instead of pulling another version. Which build that is depends on pip's
# indexes: on Linux, PyPI's is the CUDA build (see the README's Quick start for the CPU build).
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$repo_root/.venv}"
PYTHON_BIN="${PYTHON_BIN:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "Creating virtual environment in $VENV" >&2
    "$PYTHON_BIN" -m venv "$VENV" || { echo "error: could not create a virtual environment with $PYTHON_BIN" >&2; return 1; }
fi
# One stamp per requirements file: pip runs only when a file changed since it was last installed here.
install_if_changed() {
    local file="$1" stamp wanted
    stamp="$VENV/.$(basename "$file").sha256"
    wanted="$(sha256sum "$file" | cut -d' ' -f1)"
    [[ -f "$stamp" ]] && grep -qx "$wanted" "$stamp" && return 0
    echo "Installing $(basename "$file") into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$file" \
        || { echo "error: pip install -r $file failed (see above)" >&2; return 1; }
    echo "$wanted" > "$stamp"
}
install_if_changed "$repo_root/requirements.txt" || return 1
if [[ -n "${WITH_DEV:-}" ]]; then install_if_changed "$repo_root/requirements-dev.txt" || return 1; fi
# The project itself, editable (pyproject.toml): its modules import from any directory, and data/*.py and
# bench/*.py run as plain scripts. pip runs only when a name that pyproject.toml lists does not import from
# this checkout (a new environment, a new module, or an environment installed from another clone).
project_importable() {
    (cd / && "$VENV/bin/python" - "$repo_root" <<'PY'
import importlib.util, sys, tomllib
from pathlib import Path
root = Path(sys.argv[1]).resolve()
listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
names = listed["py-modules"] + [name for name in listed["packages"] if "." not in name]
specs = [importlib.util.find_spec(name) for name in names]
sys.exit(0 if all(spec and spec.origin and Path(spec.origin).resolve().is_relative_to(root) for spec in specs) else 1)
PY
    )
}
if ! project_importable; then
    echo "Installing the project (pip install -e $repo_root) into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$repo_root" \
        || { echo "error: pip install -e $repo_root failed (see above)" >&2; return 1; }
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
