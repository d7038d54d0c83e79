#!/usr/bin/env python
"""Checks before a pretraining job starts any process: the hostfile, every host over ssh, the batch arithmetic.

    python -m training.preflight --deepspeed_config scripts/deepspeed_config_bert_1.5b.json --data_dir DATA \
        --num_nodes 4 --ngpu_per_node 8 --hostfile scripts/hostsfile

The launchers (scripts/run_bert_*.sh) run it first. With one node it checks only this machine. With
several, it also:
- parses the hostfile (`host slots=N`, `#` comments): a malformed line, a duplicate host, slots that differ
  from --ngpu_per_node, or fewer hosts than --num_nodes is an error;
- asks each of the first --num_nodes hosts over ssh (in parallel, --ssh_timeout seconds each) for what the
  job relies on being the same as here: the repository at the same path with the same code, the same
  Python interpreter and version, the same versions of the packages pinned in requirements.txt, and the
  data directory.
Every problem is one line `error: preflight: host H: what differs` on stderr and the exit status is 1;
on success it prints the world size, gradient accumulation steps and global batch the DeepSpeed config
implies, and exits 0.
"""

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import json
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common import deepspeed_config
from common.errors import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent
# What every rank runs or reads.
CODE_GLOBS = ("*.py", "common/*.py", "training/*.py", "finetune/*.py", "data/*.py", "scripts/*.sh", "scripts/*.json")


class PreflightError(InputError):
    """A problem found before launch; its text is one line (one line per host)."""


@dataclass
class Host:
    name: str
    slots: int
    line: int


# ============================================================================ hostfile

def parse_hostfile(path) -> list:
    """The hosts of a DeepSpeed hostfile (`host slots=N` per line, `#` comments, blank lines ignored)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PreflightError(f"hostfile {path}: {err.strerror}") from err
    hosts, seen = [], {}
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


def hosts_for_job(hosts: list, num_nodes: int, ngpu_per_node: int, path) -> list:
    """The first num_nodes hosts (as `deepspeed --num_nodes` takes them), each with at least ngpu_per_node slots."""
    if len(hosts) < num_nodes:
        raise PreflightError(f"hostfile {path} names {len(hosts)} hosts, fewer than the {num_nodes} nodes asked for")
    used = hosts[:num_nodes]
    for host in used:
        if host.slots != ngpu_per_node:
            raise PreflightError(f"hostfile {path} line {host.line}: host {host.name} has slots={host.slots}, "
                                 f"but {ngpu_per_node} devices per node are asked for (HL_NGPU_PER_NODE)")
    return used


# ============================================================================ batch arithmetic

def read_batch_arithmetic(path, world_size: int) -> tuple:
    """(micro-batch, accumulation steps, global batch) of the DeepSpeed JSON at `path` on `world_size` ranks;
    raises deepspeed_config.DeepSpeedConfigError (the driver's check too: common/deepspeed_config.py)."""
    return deepspeed_config.batch_arithmetic(deepspeed_config.read(path), world_size, path)


# ============================================================================ what a host must share

def describe_this_host(data_dir) -> dict:
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


def pinned_versions() -> dict:
    """Installed versions of the packages pinned in requirements.txt (None when not installed)."""
    versions = {}
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        name = line.split("#", 1)[0].strip().split("==")[0].strip()
        if name:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
    return versions


def differences(name: str, here: dict, there: dict, data_dir) -> list:
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


def probe_host(name: str, data_dir, timeout: float) -> dict:
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
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightError(f"host {name}: the probe failed (exit {result.returncode}): {last}") from None


def problems_by_host(hosts: list, data_dir, timeout: float) -> dict:
    """Every host probed in parallel; {host name: its error lines (empty when it agrees with this host)}.
    The supervisor's check before a restart, too."""
    here = describe_this_host(data_dir)
    problems = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = {host.name: pool.submit(probe_host, host.name, data_dir, timeout) for host in hosts}
        for name, future in futures.items():
            try:
                problems[name] = differences(name, here, future.result(), data_dir)
            except PreflightError as err:
                problems[name] = [str(err)]
    return problems


# ============================================================================ main

def run_checks(args) -> list:
    """All checks; returns the lines to print on success, raises PreflightError with the error lines."""
    if not Path(args.data_dir).is_dir():
        raise PreflightError(f"data directory {args.data_dir} does not exist")
    world = args.num_nodes * args.ngpu_per_node
    micro, gas, total = read_batch_arithmetic(args.deepspeed_config, world)
    report = []
    if args.num_nodes > 1:
        hosts = hosts_for_job(parse_hostfile(args.hostfile), args.num_nodes, args.ngpu_per_node, args.hostfile)
        problems = problems_by_host(hosts, args.data_dir, args.ssh_timeout)
        errors = [line for lines in problems.values() for line in lines]
        if errors:
            raise PreflightError("\n".join(errors))
        report.append(f"preflight: {len(hosts)} hosts answer over ssh with the same code, Python "
                      f"{platform.python_version()} and pinned packages, and see {args.data_dir}: "
                      f"{', '.join(h.name for h in hosts)}")
    report.append(f"preflight: world size {world} ({args.num_nodes} node(s) x {args.ngpu_per_node}); global batch "
                  f"{total} = micro-batch {micro} x accumulation steps {gas} x {world} ranks ({args.deepspeed_config})")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", help="DeepSpeed JSON of the job.")
    parser.add_argument("--data_dir", required=True, help="Directory of the training shards (on every host).")
    parser.add_argument("--num_nodes", type=int, default=1, help="Hosts of the job (the first N of the hostfile).")
    parser.add_argument("--ngpu_per_node", type=int, default=8, help="Ranks per host.")
    parser.add_argument("--hostfile", default=str(REPO_ROOT / "scripts" / "hostsfile"), help="DeepSpeed hostfile.")
    parser.add_argument("--ssh_timeout", type=float, default=15.0, help="Seconds each host has to answer.")
    parser.add_argument("--describe", action="store_true", help="Print this host's description as JSON (the probe).")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.describe:
        print(json.dumps(describe_this_host(args.data_dir)))
        return 0
    if args.deepspeed_config is None or args.num_nodes < 1 or args.ngpu_per_node < 1:
        print("error: preflight: --deepspeed_config, and positive --num_nodes and --ngpu_per_node, are required",
              file=sys.stderr)
        return 2
    try:
        for line in run_checks(args):
            print(line, flush=True)
    except InputError as err:  # PreflightError, or the DeepSpeed JSON's DeepSpeedConfigError
        for line in str(err).splitlines():
            print(f"error: preflight: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
