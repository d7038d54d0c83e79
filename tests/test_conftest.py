"""The test harness itself (tests/conftest.py): a session stopped by SIGTERM still tears its fixtures down."""

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
