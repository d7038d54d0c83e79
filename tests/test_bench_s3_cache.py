"""bench/bench_s3_cache.py's report: each side's rate per round, and the ratio of the two, round by round."""

import importlib.util

import helpers


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_s3_cache", helpers.REPO_ROOT / "bench" / "bench_s3_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ratio_is_of_the_rates_of_one_round(capsys):
    """Rounds of 64 MiB: the fill at 64 and 16 MiB/s, the plain loop at 128 and 128: ratios 0.5 and 0.125 (not
    the ratio of the best rates, 0.5 alone, nor of the times)."""
    mib = 2 ** 20
    load_bench().report({"ShardCache fill": [(1.0, 64 * mib), (4.0, 64 * mib)],
                         "plain get_object": [(0.5, 64 * mib), (0.5, 64 * mib)]})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [
        ["ShardCache", "fill", "64.0", "16.0", "MiB/s", "(best", "64.0)"],
        ["plain", "get_object", "128.0", "128.0", "MiB/s", "(best", "128.0)"],
        ["fill", "/", "plain", "0.500", "0.125", "(median", "0.312)"]]
