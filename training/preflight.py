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
import json
import platform
import sys
from pathlib import Path

from common.deepspeed_config import read_batch_arithmetic
from common.errors import InputError
from training.hosts import (
    REPO_ROOT,
    PreflightError,
    describe_this_host,
    hosts_for_job,
    parse_hostfile,
    problems_by_host,
)

# ============================================================================ main

def run_checks(args: argparse.Namespace) -> list[str]:
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


def main(argv: list[str] | None = None) -> int:
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
