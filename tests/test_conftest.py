"""The test harness itself (tests/conftest.py): a session stopped by SIGTERM still tears its fixtures down; a session
with another ATEN_CPU_CAPABILITY gets an inductor cache of its own; a test's compile settings do not reach the next
test file; a DeepSpeed engine a test built is finalized when that test ends."""

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

from training import compile_mode


class Engine:  # stands in for a DeepSpeed engine: compile_model calls its compile()
    def compile(self, backend, compile_kwargs):
        pass


def test_compiles():
    compile_mode.compile_model(Engine(), "inductor", None)
    assert torch._inductor.config.fallback_random
"""

LATER_TEST = """\
import torch


def test_sees_the_default():
    import torch._inductor.config
    assert torch._inductor.config.fallback_random is False
"""


def test_a_compiled_run_leaves_no_compile_setting_to_the_next_test_file(tmp_path):
    """compile_mode.compile_model sets inductor's fallback_random for the rest of its process; in a session of
    several files (one pytest-xdist worker) the next file must still see torch's default."""
    (tmp_path / "test_a_compiles.py").write_text(COMPILING_TEST)
    (tmp_path / "test_b_later.py").write_text(LATER_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(helpers.REPO_ROOT / "tests"), str(helpers.REPO_ROOT)]))
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                              "test_a_compiles.py", "test_b_later.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert session.returncode == 0 and "2 passed" in session.stdout, session.stdout[-3000:] + session.stderr[-2000:]


ENGINE_LEFT_BEHIND_TEST = """\
import gc
import weakref

import torch

from training import deepspeed_engine, distributed
{import_deepspeed}
ENGINES = []


def test_makes_an_engine_and_drops_it():
    gc.disable()  # from here only deliberate collections: not one that happens to come before the next test
    distributed.setup_device_and_distributed(distributed.Job(), use_hpu=False, no_cuda=True)
    model = torch.nn.Linear(8, 8)
    config = {{"train_micro_batch_size_per_gpu": 2, "bf16": {{"enabled": True}}, "zero_optimization": {{"stage": 1}},
               "zero_allow_untested_optimizer": True}}
    engine, _ = deepspeed_engine.initialize_engine(model, config, torch.optim.AdamW(model.parameters()))
    with deepspeed_engine.destroyed_on_exit(engine):  # destroyed, as the driver destroys its own
        engine.backward(engine(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum())
        engine.step()
    ENGINES.append(weakref.ref(engine))


def test_the_engine_is_gone_when_the_next_test_starts():
    alive = ENGINES[0]() is not None
    gc.enable()
    assert not alive
"""


@pytest.mark.parametrize("import_deepspeed", ["import deepspeed  # noqa: F401", ""],
                         ids=["deepspeed_imported_at_collection", "deepspeed_imported_by_the_test"])
def test_an_engine_a_test_built_is_finalized_when_that_test_ends(tmp_path, import_deepspeed):
    """A bf16 ZeRO-1 engine, destroyed as the driver destroys its own, stays in DeepSpeed's reference cycles until a
    collection: tests/conftest.py's engines_destroyed collects when the test that built it ends, so that the GC
    never finalizes it inside a later test's torch.compile (docs/results.md: 400 s for the fine-tuning compile
    test). The inner session turns automatic collection off; without that collection the engine is still alive
    in the second test. Both where the session imported deepspeed before the test (a whole suite: at
    collection) and where the test is the first to import it (its engines go unrecorded)."""
    test_file = ENGINE_LEFT_BEHIND_TEST.format(import_deepspeed=import_deepspeed)
    (tmp_path / "test_engine_left_behind.py").write_text(test_file)
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(helpers.REPO_ROOT / "tests"), str(helpers.REPO_ROOT)]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the inner session is a world of one of its own
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                              "test_engine_left_behind.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert session.returncode == 0 and "2 passed" in session.stdout, session.stdout[-3000:] + session.stderr[-2000:]
