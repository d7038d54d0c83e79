"""The test harness itself (tests/conftest.py): a session stopped by SIGTERM still tears its fixtures down; a session
with another ATEN_CPU_CAPABILITY gets an inductor cache of its own; a test's compile settings do not reach the next
test file."""

import os
import signal
import subprocess
import sys
import time

import pytest

import helpers

WAITING_TEST = """\
import pathlib
import time

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="session")
def resource():  # stands in for the test hosts and the S3 server
    yield
    (HERE / "torn_down").write_text("yes")


def test_waits(resource):
    (HERE / "ready").write_text("yes")
    time.sleep(120)
"""


@pytest.mark.parametrize("workers", ["0", "1"], ids=["plain", "xdist"])
def test_sigterm_to_the_session_still_tears_down_session_fixtures(tmp_path, workers):
    """A CI timeout signals the whole process group (pytest and its xdist workers): the session must end as
    after Ctrl-C, with exit status 2 and its session fixtures torn down."""
    (tmp_path / "test_waiting.py").write_text(WAITING_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(helpers.REPO_ROOT / "tests"), str(helpers.REPO_ROOT)]))
    # `-p conftest` loads tests/conftest.py as a plugin into a session rooted in tmp_path
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                                "--numprocesses", workers, "test_waiting.py"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert session.poll() is None and time.monotonic() < deadline, session.communicate(timeout=10)[0]
            time.sleep(0.2)
        os.killpg(session.pid, signal.SIGTERM)
        out, _ = session.communicate(timeout=60)
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
    assert (tmp_path / "torn_down").exists(), out
    assert session.returncode == pytest.ExitCode.INTERRUPTED, out


@pytest.mark.parametrize("environ,expected", [
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "torchinductor_{user}_avx2"),  # a cache of its own
    ({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/mine"}, "/mine"),  # the user's choice wins
    ({}, None)])  # inductor's default
def test_a_session_with_another_cpu_capability_gets_its_own_inductor_cache(monkeypatch, environ, expected):
    import getpass
    import tempfile

    import conftest
    for key in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(key, "")  # recorded, so that teardown restores the variable the function sets; a
        monkeypatch.delenv(key)      # delenv of an unset variable records nothing
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    conftest.inductor_cache_per_cpu_capability()
    if expected and not expected.startswith("/"):
        expected = os.path.join(tempfile.gettempdir(), expected.format(user=getpass.getuser()))
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == expected


COMPILING_TEST = """\
import torch

from training import runtime


class Engine:  # stands in for a DeepSpeed engine: compile_model calls its compile()
    def compile(self, backend, compile_kwargs):
        pass


def test_compiles():
    runtime.compile_model(Engine(), "inductor", None)
    assert torch._inductor.config.fallback_random
"""

LATER_TEST = """\
import torch


def test_sees_the_default():
    import torch._inductor.config
    assert torch._inductor.config.fallback_random is False
"""


def test_a_compiled_run_leaves_no_compile_setting_to_the_next_test_file(tmp_path):
    """runtime.compile_model sets inductor's fallback_random for the rest of its process; in a session of
    several files (one pytest-xdist worker) the next file must still see torch's default."""
    (tmp_path / "test_a_compiles.py").write_text(COMPILING_TEST)
    (tmp_path / "test_b_later.py").write_text(LATER_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(helpers.REPO_ROOT / "tests"), str(helpers.REPO_ROOT)]))
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                              "test_a_compiles.py", "test_b_later.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert session.returncode == 0 and "2 passed" in session.stdout, session.stdout[-3000:] + session.stderr[-2000:]
