"""training/preflight.py: every problem is one error line naming the host and what differs; success prints the batch
arithmetic. The ssh checks run against the test hosts (tests/multihost.py; root only, skipped otherwise)."""

import json
import subprocess
import sys

import pytest

import helpers
from training import hosts


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "data").mkdir()
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=4, gas=3, world=2)
    return tmp_path, ds_config


def run(args, env=None, command_prefix=()):
    return subprocess.run([*command_prefix, sys.executable, "-m", "training.preflight", *map(str, args)], env=env,
                          cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=120)


def one_error_line(result) -> str:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: preflight: "), result.stderr
    return lines[0][len("error: preflight: "):]


@pytest.mark.parametrize("text,message", [
    ("a slots=1\nb\n", "line 2: expected 'host slots=N', got 'b'"),
    ("a slots=1\na slots=1\n", "line 2: host a is listed twice (first on line 1)"),
    ("# servers\n\na slots=x\n", "line 3: slots must be a positive integer, got 'x'"),
    ("a slots=0\n", "line 1: slots must be a positive integer, got '0'"),
    ("a slots=1 extra\n", "line 1: expected 'host slots=N', got 'a slots=1 extra'"),
    ("# only a comment\n", "names no host"),
    ("a slots=1\n", "names 1 hosts, fewer than the 2 nodes asked for"),
    ("a slots=1 # first\nb slots=2\n", "line 2: host b has slots=2, but 1 devices per node are asked for"),
])
def test_each_hostfile_problem_is_one_line(inputs, text, message):
    tmp_path, ds_config = inputs
    (tmp_path / "hostfile").write_text(text)
    line = one_error_line(run(["--deepspeed_config", ds_config, "--data_dir", tmp_path / "data", "--num_nodes", 2,
                               "--ngpu_per_node", 1, "--hostfile", tmp_path / "hostfile"]))
    assert line.startswith(f"hostfile {tmp_path / 'hostfile'}") and message in line, line


def test_hostfile_comments_and_blank_lines_are_ignored(tmp_path):
    (tmp_path / "h").write_text("# cluster\n\n  a slots=8  # rack 1\nb slots=8\n")
    parsed = hosts.parse_hostfile(tmp_path / "h")
    assert [(h.name, h.slots, h.line) for h in parsed] == [("a", 8, 3), ("b", 8, 4)]


@pytest.mark.parametrize("args,message", [
    (["--num_nodes", 1, "--ngpu_per_node", 4],
     "train_batch_size 24 is not a multiple of train_micro_batch_size_per_gpu 4 x world size 4"),
    (["--num_nodes", 1, "--ngpu_per_node", 2, "--data_dir", "/nonexistent"],
     "data directory /nonexistent does not exist"),
    (["--num_nodes", 2, "--ngpu_per_node", 1, "--hostfile", "/nonexistent"], "hostfile /nonexistent: No such file"),
])
def test_local_problems_are_one_line(inputs, args, message):
    tmp_path, ds_config = inputs
    base = ["--deepspeed_config", ds_config, "--data_dir", tmp_path / "data"]
    assert message in one_error_line(run(base + args))


def test_one_node_prints_the_batch_arithmetic(inputs):
    tmp_path, ds_config = inputs
    result = run(["--deepspeed_config", ds_config, "--data_dir", tmp_path / "data", "--num_nodes", 1,
                  "--ngpu_per_node", 2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"preflight: world size 2 (1 node(s) x 2); global batch 24 = micro-batch 4 x "
                                     f"accumulation steps 3 x 2 ranks ({ds_config})")


def test_each_difference_of_a_host_is_one_line_naming_it(tmp_path):
    here = hosts.describe_this_host(tmp_path)
    assert here["data_dir"] and here["packages"]["torch"] and here["code"] == hosts.code_digest()
    there = json.loads(json.dumps(here))
    there.update(code="0" * 12, python_version="3.10.1", data_dir=False)
    there["packages"].update(torch="2.0.0", deepspeed=None)
    lines = hosts.differences("n2", here, there, tmp_path)
    assert lines == [
        f"host n2: the code in {hosts.REPO_ROOT} differs from this host's (digest {'0' * 12}, here {here['code']})",
        f"host n2: Python 3.10.1 (here {here['python_version']})",
        f"host n2: torch 2.0.0 (here {here['packages']['torch']})",
        f"host n2: deepspeed is not installed (here {here['packages']['deepspeed']})",
        f"host n2: data directory {tmp_path} does not exist"]
    assert hosts.differences("n2", here, here, tmp_path) == []


# ---------------------------------------------------------------- over ssh, against the test hosts

def preflight_on_first_host(hosts, tmp_path, ds_config, hostfile, nodes, timeout=10):
    return run(["--deepspeed_config", ds_config, "--data_dir", tmp_path / "data", "--num_nodes", nodes,
                "--ngpu_per_node", 1, "--hostfile", hostfile, "--ssh_timeout", timeout],
               env=hosts.env(), command_prefix=hosts.command_on(0, [])[:4])


def test_three_hosts_pass_and_the_batch_arithmetic_is_printed(test_hosts, tmp_path):
    (tmp_path / "data").mkdir()
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=2, gas=2, world=3)
    hostfile = test_hosts.hostfile(tmp_path / "hostfile", hosts=3)
    result = preflight_on_first_host(test_hosts, tmp_path, ds_config, hostfile, 3)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"preflight: 3 hosts answer over ssh with the same code, Python {sys.version.split()[0]} and pinned packages, "
        f"and see {tmp_path / 'data'}: 10.200.0.1, 10.200.0.2, 10.200.0.3",
        f"preflight: world size 3 (3 node(s) x 1); global batch 12 = micro-batch 2 x accumulation steps 2 x 3 ranks "
        f"({ds_config})"]


def test_a_host_that_does_not_answer_is_one_line(test_hosts, tmp_path):
    (tmp_path / "data").mkdir()
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=2, world=2)
    (tmp_path / "hostfile").write_text("10.200.0.1 slots=1\n10.200.0.77 slots=1\n")  # no such host
    line = one_error_line(preflight_on_first_host(test_hosts, tmp_path, ds_config, tmp_path / "hostfile", 2,
                                                  timeout=3))
    assert line.startswith("host 10.200.0.77: "), line
    assert "ssh failed" in line or "no answer over ssh within 3 s" in line, line
