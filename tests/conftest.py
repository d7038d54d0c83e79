"""Session fixtures shared by the test files: tiny shards made inside the session, and an S3 server on
127.0.0.1 (moto_server); nothing reaches the network."""

import collections
import gc
import itertools
import os
import signal
import sys
import warnings

import pytest

import helpers


def pytest_configure(config):
    """SIGTERM (a CI job's timeout, `kill`) ends the session as Ctrl-C does, so that the session fixtures
    still tear down: by default it kills pytest at once and leaves the test hosts' namespaces and sshd
    processes and the S3 server running. Each pytest-xdist worker installs it too (the workers own the
    fixtures)."""
    session_pid = os.getpid()

    def interrupt(signum, frame):
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM, e.g. during a hung teardown, kills
        if os.getpid() != session_pid:  # a forked child (multiprocessing) that inherited the handler
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    inductor_cache_per_cpu_capability()


def inductor_cache_per_cpu_capability():
    """Trap: ATEN_CPU_CAPABILITY (e.g. avx2 on an AVX-512 machine, to run the suite with an older CPU's
    kernels) also sets inductor's vector width, but inductor's cache of compiled graphs does not tell the
    widths apart: code generated for 16 floats per vector was built for 8 and crashed (SIGSEGV in
    test_compile.py's fine-tuning test) or computed wrong updates (test_lans.py's compiled tests). Such a
    session gets a cache of its own, one per capability, unless TORCHINDUCTOR_CACHE_DIR is set; the child
    processes inherit it."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import getpass
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")


def pytest_collection_modifyitems(items):
    """Files with the most slow tests first, files without any last (the order inside a file is kept).
    .ci/run hands whole files to two pytest-xdist workers in this order (--dist loadfile
    --no-loadscope-reorder; without that flag xdist sends the files with the most tests first, and the
    demo and the fault injection, one long test each, started last): the long files start first, and the
    many short ones fill the end, so neither worker idles while the other runs a long file."""
    slow_tests = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (-slow_tests[item.path], first_seen[item.path]))


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """Three training shards of unequal sizes (24 + 40 + 17 = 81 samples, seq_len 32, 5 masked
    positions each) plus a file without 'training' in its name, which must be ignored."""
    directory = tmp_path_factory.mktemp("tiny_shards")
    helpers.write_synthetic_shards(directory, [24, 40, 17])
    helpers.write_synthetic_shards(directory, [5], name="held_out_{i}_test.hdf5", seed=1)
    return directory


def make_pipeline_shards(directory, book: str, lines: int, shard_name: str, seq_len: int = 128, max_pred: int = 20):
    """Shards (seq_len, max_pred predictions) made by the real data/create_pretraining_data.py from the first `lines`
    lines of data/sample/books/<book> (paragraphs become documents, lines sentences); returns `directory`."""
    import gzip
    import subprocess

    with gzip.open(helpers.REPO_ROOT / "data" / "sample" / "books" / book, "rt") as f:
        text = "".join(f.readlines()[:lines])
    # Blank-line runs separate documents; single lines are the "sentences".
    documents = ["\n".join(line.strip() for line in block.splitlines() if line.strip())
                 for block in text.split("\n\n") if block.strip()]
    source = directory / "source.txt"
    source.write_text("\n\n".join(documents) + "\n")
    subprocess.run([sys.executable, str(helpers.REPO_ROOT / "data" / "create_pretraining_data.py"),
                    "--input_file", str(source), "--output_file", str(directory / shard_name),
                    "--vocab_file", str(helpers.REPO_ROOT / "data" / "vocab.txt"), "--max_seq_length", str(seq_len),
                    "--max_predictions_per_seq", str(max_pred), "--dupe_factor", "1", "--n_processes", "1"],
                   check=True, capture_output=True, timeout=300, env=helpers.checkout_env())
    source.unlink()
    return directory


@pytest.fixture(scope="session")
def pipeline_shards(tmp_path_factory):
    """Phase-1 shards made by the real data/create_pretraining_data.py from the first chapters of a novel in
    data/sample/ (make_pipeline_shards)."""
    return make_pipeline_shards(tmp_path_factory.mktemp("pipeline_shards"), "persuasion_part1.txt.gz", 1200,
                                "persuasion_training_0.hdf5")


@pytest.fixture(scope="session")
def pipeline_held_out(tmp_path_factory):
    """Held-out shards made as pipeline_shards' from text that pipeline_shards lacks: the start of the novel's
    second part."""
    return make_pipeline_shards(tmp_path_factory.mktemp("pipeline_held_out"), "persuasion_part2.txt.gz", 300,
                                "persuasion_test_0.hdf5")


_BUCKET_NUMBERS = itertools.count()  # one new bucket per test, never reused within the session


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """A real S3-compatible server (moto_server) on 127.0.0.1 for the session; see s3_helpers."""
    import s3_helpers
    server = s3_helpers.MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def s3(moto_server, tmp_path, monkeypatch, request):
    """Environment of boto3 pointed at the session's server, and a fresh bucket named after the test;
    returns (server, bucket, raw boto3 client for setting things up)."""
    import re

    import s3_helpers
    for key, value in s3_helpers.s3_env(moto_server, tmp_path).items():
        monkeypatch.setenv(key, value)
    import boto3
    boto3.setup_default_session()  # a session resolves credentials once: a fresh one for this environment
    bucket = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{next(_BUCKET_NUMBERS)}"
    client = s3_helpers.make_bucket(moto_server, bucket)
    return moto_server, bucket, client


def pretrain_tiny(work, shards, config_file=helpers.TINY_MODEL_CONFIG):
    """A short real pretraining with the demo's settings (scripts/run_bert_tiny_cpu.sh: LANS, PolyWarmUp,
    learning rate 0.02, bf16, ZeRO-1, global batch 64) on one rank for 40 steps, on `shards`. Returns the
    run's checkpoint directory (DeepSpeed format, ZeRO-1 partitions: fine-tuning consolidates it on load)."""
    ds_config = helpers.write_ds_config(work / "ds.json", stage=1, bf16=True, micro=32, gas=2)
    argv = helpers.driver_argv(shards, work / "checkpoints", ds_config, json_summary=work / "dllogger.json",
                               config_file=config_file, max_predictions_per_seq=20, seed=12439, learning_rate=0.02,
                               warmup_proportion=0.1, max_steps=40, num_steps_per_checkpoint=40, log_freq=10,
                               use_lr_scheduler=True, disable_progress_bar=True)
    result = helpers.run_single_process(argv, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "checkpoints"


@pytest.fixture(scope="session")
def pretrained_tiny_checkpoint(tmp_path_factory, pipeline_shards):
    """pretrain_tiny with the demo's tiny pre-LN config on the real-text shards of `pipeline_shards`.
    Shared by the fine-tuning tests (GLUE, weight sources, ranks)."""
    return pretrain_tiny(tmp_path_factory.mktemp("pretrained_tiny"), pipeline_shards)


@pytest.fixture(scope="session")
def pretrained_tiny_post_ln(tmp_path_factory, pipeline_shards):
    """(checkpoint directory, config file): pretrain_tiny with the tiny config in the post-LN wiring
    (layer_norm_large_model false), for the SQuAD learning check (see tests/test_run_squad.py)."""
    import json
    work = tmp_path_factory.mktemp("pretrained_tiny_post_ln")
    config = json.loads(helpers.TINY_MODEL_CONFIG.read_text())
    config["layer_norm_large_model"] = False
    (work / "config.json").write_text(json.dumps(config))
    return pretrain_tiny(work, pipeline_shards, work / "config.json"), work / "config.json"


@pytest.fixture(scope="session")
def test_hosts(tmp_path_factory):
    """Four test hosts 10.200.0.1-4 (network namespaces with their own sshd; tests/multihost.py), torn down
    at the end of the session. Skipped, with the reason in the summary, where the machine cannot make them."""
    import multihost

    reason = multihost.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with multihost.TestHosts(tmp_path_factory.mktemp("test_hosts"), count=4) as hosts:
        yield hosts


@pytest.fixture
def every_cpu_thread():
    """torch uses this worker's share of the CPUs for this test (the suite runs with OMP_NUM_THREADS=1): for
    the long single-process fine-tuning checks, which take about a quarter less time on 2 cores than on 1
    (docs/results.md). Under pytest-xdist the workers split the CPUs: two workers that each spin 2 OpenMP
    threads on 2 cores made the SQuAD check 4x slower (364 s against 89 s)."""
    import os

    import torch
    threads = torch.get_num_threads()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def compile_settings_restored():
    """torch.compile's settings (inductor's and dynamo's) as they were before the test. compile_mode.compile_model
    sets inductor's fallback_random for the rest of its process, which is right for a training process; in
    the suite an in-process compiled run (tests/test_compile.py) changed the settings, and with them inductor's
    cache keys, of every later test file in its worker (pytest-xdist --dist loadfile): those ran compiled code
    under other settings than alone or in another order. Only where the test session has imported torch."""
    if "torch" not in sys.modules:
        yield
        return
    import torch._dynamo.config
    import torch._inductor.config
    before = {config: config.get_config_copy() for config in (torch._inductor.config, torch._dynamo.config)}
    yield
    with warnings.catch_warnings():  # reading torch's deprecated dynamo settings warns (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        for config, values in before.items():
            config.load_config({name: value for name, value in values.items() if getattr(config, name) != value})


@pytest.fixture(autouse=True)
def engines_destroyed(monkeypatch):
    """Every DeepSpeed engine that deepspeed.initialize built during the test is destroyed after it. DeepSpeed's
    gradient hooks keep an engine, its model and optimizer states alive until destroy(), and the driver does
    not destroy it when a run ends in an error (deepspeed_engine.destroyed_on_exit: that process ends anyway): in the
    suite each in-process run that ended in an error, and each engine a test built itself
    (tests/test_checkpointing.py), was left to every later test file of its worker (a one-process run of the
    default suite in CI order ended with 59 live engines, counted with gc: 43 of test_checkpointing.py, 12 of
    tests/test_driver.py's error cases). Only once the session has imported deepspeed (importing it here
    would choose DeepSpeed's accelerator before the tests do).

    Then a garbage collection finalizes them. Trap: DeepSpeed's own hooks and closures keep an engine in
    reference cycles after destroy() too, so it is freed whenever the cyclic GC next runs: in a later test,
    possibly inside torch.compile's tracing. DeepSpeedEngine.__del__ calls destroy() again, whose ZeRO loop calls
    is_pinned on each optimizer state; under the trace's FakeTensorMode that real tensor raises, and the message
    formats the whole tensor, about 10 us per element (24 s for a tiny-model engine): in CI
    tests/test_compile.py::test_fine_tuning_compiled_follows_eager took 400 s instead of tens (docs/results.md)."""
    if "deepspeed" not in sys.modules:
        yield
        if "deepspeed" in sys.modules:  # imported by this test: the engines it built went unrecorded
            gc.collect()
        return
    import weakref

    import deepspeed
    built = []
    initialize = deepspeed.initialize

    def initialize_recorded(*args, **kwargs):
        result = initialize(*args, **kwargs)
        built.append(weakref.ref(result[0]))
        return result

    monkeypatch.setattr(deepspeed, "initialize", initialize_recorded)
    yield
    for ref in reversed(built):
        if ref() is not None:  # no local name holds the engine: the collection below must find it unreachable
            ref().destroy()
    if built:
        gc.collect()


@pytest.fixture(autouse=True)
def no_habana_bridge_left_behind():
    """The stand-in Habana bridge (tests/fake_habana) must not outlive the test that imported it: the driver
    treats an imported habana_frameworks as a Gaudi run (checkpointing saves the HPU RNG)."""
    before = {name for name in sys.modules if name.startswith("habana_frameworks")}
    yield
    left = sorted({name for name in sys.modules if name.startswith("habana_frameworks")} - before)
    assert not left, f"this test left the stand-in Habana bridge imported: {left}"
