"""The hosts of a job and what each must share with the launching one: the hostfile, and a probe over ssh of
the repository (path and code), the Python interpreter, the pinned packages and the data directory. Used by
the preflight (training/preflight.py) before a launch and by the supervisor before each restart."""

import concurrent.futures
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

from common.errors import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent
# What every rank runs or reads.
CODE_GLOBS = ("*.py", "common/*.py", "training/*.py", "finetune/*.py", "data/*.py", "scripts/*.sh", "scripts/*.json")


class PreflightError(InputError):
    """A problem found before launch or restart; its text is one line (one line per host)."""


@dataclass
class Host:
    name: str
    slots: int
    line: int


class HostDescription(TypedDict):
    """What describe_this_host reports (as JSON, from another host)."""
    repository: str
    code: str  # code_digest()
    python: str
    python_version: str
    packages: dict[str, str | None]  # pinned_versions()
    data_dir: bool  # whether the data directory exists there


# ============================================================================ hostfile

def parse_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """The hosts of a DeepSpeed hostfile (`host slots=N` per line, `#` comments, blank lines ignored)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PreflightError(f"hostfile {path}: {err.strerror}") from err
    hosts: list[Host] = []
    seen: dict[str, int] = {}  # host name -> its line
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise PreflightError(f"hostfile {path} line {number}: expected 'host slots=N', got {raw.strip()!r}")
        name, slots = fields[0], fields[1][len("slots="):]
        if not slots.isdigit() or int(slots) < 1:
            raise PreflightError(f"hostfile {path} line {number}: slots must be a positive integer, got {slots!r}")
        if name in seen:
            raise PreflightError(f"hostfile {path} line {number}: host {name} is listed twice "
                                 f"(first on line {seen[name]})")
        seen[name] = number
        hosts.append(Host(name, int(slots), number))
    if not hosts:
        raise PreflightError(f"hostfile {path} names no host")
    return hosts


def hosts_for_job(hosts: list[Host], num_nodes: int, ngpu_per_node: int, path: str | os.PathLike[str]) -> list[Host]:
    """The first num_nodes hosts (as `deepspeed --num_nodes` takes them), each with at least ngpu_per_node slots."""
    if len(hosts) < num_nodes:
        raise PreflightError(f"hostfile {path} names {len(hosts)} hosts, fewer than the {num_nodes} nodes asked for")
    used = hosts[:num_nodes]
    for host in used:
        if host.slots != ngpu_per_node:
            raise PreflightError(f"hostfile {path} line {host.line}: host {host.name} has slots={host.slots}, "
                                 f"but {ngpu_per_node} devices per node are asked for (HL_NGPU_PER_NODE)")
    return used


# ============================================================================ what a host must share

def describe_this_host(data_dir: str | os.PathLike[str]) -> HostDescription:
    """What must be equal on every host (the probe that runs on each one, and here)."""
    return {"repository": str(REPO_ROOT), "code": code_digest(), "python": sys.executable,
            "python_version": platform.python_version(), "packages": pinned_versions(),
            "data_dir": Path(data_dir).is_dir()}


def code_digest() -> str:
    digest = hashlib.sha256()
    for pattern in CODE_GLOBS:
        for path in sorted(REPO_ROOT.glob(pattern)):
            digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def pinned_versions() -> dict[str, str | None]:
    """Installed versions of the packages pinned in requirements.txt (None when not installed)."""
    versions: dict[str, str | None] = {}
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        name = line.split("#", 1)[0].strip().split("==")[0].strip()
        if name:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
    return versions


def differences(name: str, here: HostDescription, there: HostDescription,
                data_dir: str | os.PathLike[str]) -> list[str]:
    """One line per difference between this host's description and host `name`'s."""
    lines = []
    if there["code"] != here["code"]:
        lines.append(f"host {name}: the code in {here['repository']} differs from this host's "
                     f"(digest {there['code']}, here {here['code']})")
    if there["python_version"] != here["python_version"]:
        lines.append(f"host {name}: Python {there['python_version']} (here {here['python_version']})")
    for package, version in here["packages"].items():
        theirs = there["packages"].get(package)
        if theirs != version:
            lines.append(f"host {name}: {package} {theirs or 'is not installed'} (here {version or 'not installed'})")
    if not there["data_dir"]:
        lines.append(f"host {name}: data directory {data_dir} does not exist")
    return lines


def probe_host(name: str, data_dir: str | os.PathLike[str], timeout: float) -> HostDescription:
    """describe_this_host() run on `name` over ssh; PreflightError (one line) when that fails."""
    remote = (f"cd {shlex.quote(str(REPO_ROOT))} 2>/dev/null || {{ echo 'no such directory' >&2; exit 3; }}; "
              f"test -x {shlex.quote(sys.executable)} || {{ echo 'no such interpreter' >&2; exit 4; }}; "
              f"exec {shlex.quote(sys.executable)} -m training.preflight --describe "
              f"--data_dir {shlex.quote(str(data_dir))}")
    command = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", name, remote]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"host {name}: no answer over ssh within {timeout:g} s") from None
    if result.returncode == 3:
        raise PreflightError(f"host {name}: the repository directory {REPO_ROOT} does not exist there")
    if result.returncode == 4:
        raise PreflightError(f"host {name}: the Python interpreter {sys.executable} does not exist there")
    if result.returncode == 255:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "ssh failed"
        raise PreflightError(f"host {name}: ssh failed: {reason}")
    try:
        return cast(HostDescription, json.loads(result.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightError(f"host {name}: the probe failed (exit {result.returncode}): {last}") from None


def problems_by_host(hosts: list[Host], data_dir: str | os.PathLike[str], timeout: float) -> dict[str, list[str]]:
    """Every host probed in parallel; {host name: its error lines (empty when it agrees with this host)}.
    The supervisor's check before a restart, too."""
    here = describe_this_host(data_dir)
    problems: dict[str, list[str]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = {host.name: pool.submit(probe_host, host.name, data_dir, timeout) for host in hosts}
        for name, future in futures.items():
            try:
                problems[name] = differences(name, here, future.result(), data_dir)
            except PreflightError as err:
                problems[name] = [str(err)]
    return problems
