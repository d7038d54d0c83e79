#!/usr/bin/env bash
# The project's lint: ruff (rules in pyproject.toml) on the Python files, the mypy type check (settings and the
# modules it covers in pyproject.toml), shellcheck (settings in .shellcheckrc) on the shell scripts. Exits non-zero
# on any finding. ruff, mypy and shellcheck come from requirements-dev.txt: run it inside the test environment
# (`source .venv/bin/activate` once scripts/run_tests.sh has made it).
#   bash scripts/lint.sh              the whole tree: ruff on it, mypy on the files pyproject.toml lists, shellcheck
#                                     on every tracked *.sh and .ci/run
#   bash scripts/lint.sh PATH...      only these files and directories (*.sh, and .ci/run, go to shellcheck; the
#                                     Python ones to ruff and to mypy, at the tree's strictness)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

for tool in ruff mypy shellcheck; do
    command -v "$tool" > /dev/null || {
        echo "error: $tool is not installed here: run inside the test environment (WITH_DEV=1 source scripts/setup_venv.sh)" >&2
        exit 2
    }
done

python_paths=()
shell_files=()
if (( $# == 0 )); then
    cd "$repo_root"
    python_paths=(.)
    mapfile -t shell_files < <(git ls-files '*.sh')
    shell_files+=(.ci/run)
else
    for path in "$@"; do
        if [[ -d "$path" ]]; then
            python_paths+=("$path")
            mapfile -t -O "${#shell_files[@]}" shell_files < <(find "$path" -name '*.sh' -type f | sort)
        elif [[ "$path" == *.sh || "$path" == */.ci/run || "$path" == .ci/run ]]; then
            shell_files+=("$path")
        else
            python_paths+=("$path")
        fi
    done
fi

status=0
if (( ${#python_paths[@]} > 0 )); then
    # The repository's configuration, also for paths outside it.
    python_count=$(ruff check --config "$repo_root/pyproject.toml" --show-files "${python_paths[@]}" | wc -l)
    echo "== ruff $(ruff --version | cut -d' ' -f2): $python_count Python files in ${python_paths[*]}"
    ruff check --config "$repo_root/pyproject.toml" "${python_paths[@]}" || status=1
fi
mypy_command=(mypy --config-file "$repo_root/pyproject.toml" --cache-dir "$repo_root/.mypy_cache")
if (( $# == 0 )); then
    echo "== $(mypy --version | cut -d' ' -f1-2): the files of pyproject.toml's [tool.mypy]"
    "${mypy_command[@]}" || status=1
elif (( ${#python_paths[@]} > 0 )); then
    echo "== $(mypy --version | cut -d' ' -f1-2): ${python_paths[*]}"
    "${mypy_command[@]}" "${python_paths[@]}" || status=1
fi
if (( ${#shell_files[@]} > 0 )); then
    echo "== shellcheck $(shellcheck --version | sed -n 's/^version: //p'): ${shell_files[*]}"
    shellcheck --rcfile "$repo_root/.shellcheckrc" "${shell_files[@]}" || status=1
fi
if (( status != 0 )); then echo "error: lint findings above" >&2; fi
exit "$status"
