"""dllogger_fallback: the DLLL JSON lines parse back into NVIDIA's record layout; verbosity rules;
the stdout line; init/log ordering errors."""

import json
from datetime import datetime

import numpy as np
import pytest
import torch

from training import dllogger_fallback as dllogger


@pytest.fixture(autouse=True)
def fresh_logger(monkeypatch):
    """Each test starts with the module-level logger uninitialised."""
    monkeypatch.setattr(dllogger, "_logger", None)


def read_records(path):
    lines = path.read_text().splitlines()
    assert all(line.startswith("DLLL {") for line in lines), lines
    return [json.loads(line[len("DLLL "):]) for line in lines]


def test_json_lines_have_nvidia_layout(tmp_path):
    path = tmp_path / "log.json"
    dllogger.init(backends=[dllogger.JSONStreamBackend(dllogger.Verbosity.VERBOSE, str(path))])
    dllogger.metadata("loss", {"unit": "nats", "format": ":.4f"})
    dllogger.log(step="PARAMETER", data={"seed": 42, "config": "x"})
    dllogger.log(step=(1, 5), data={"loss": torch.tensor(2.5), "lr": np.float32(0.25)})
    dllogger.log(step=(), data={"final_loss": 1.0}, verbosity=dllogger.Verbosity.VERBOSE)
    dllogger.flush()

    records = read_records(path)
    assert [r["type"] for r in records] == ["METADATA", "LOG", "LOG", "LOG"]
    assert records[0]["metric"] == "loss" and records[0]["metadata"] == {"unit": "nats", "format": ":.4f"}
    assert [r["step"] for r in records[1:]] == ["PARAMETER", [1, 5], []]
    assert [r["data"] for r in records[1:]] == [{"seed": 42, "config": "x"}, {"loss": 2.5, "lr": 0.25},
                                                {"final_loss": 1.0}]
    for record in records:
        header = ["timestamp", "datetime", "elapsedtime", "type"]
        assert list(record)[:4] == header
        moment = datetime.fromisoformat(record["datetime"])
        assert moment.utcoffset() is not None
        assert abs(moment.timestamp() - float(record["timestamp"])) < 1e-5
        assert float(record["elapsedtime"]) >= 0.0
    stamps = [float(r["timestamp"]) for r in records]
    assert stamps == sorted(stamps)


def test_verbosity_filters_per_backend(tmp_path, capsys):
    quiet, loud, off = tmp_path / "quiet.json", tmp_path / "loud.json", tmp_path / "off.json"
    dllogger.init(backends=[dllogger.JSONStreamBackend(dllogger.Verbosity.DEFAULT, str(quiet)),
                            dllogger.JSONStreamBackend(dllogger.Verbosity.VERBOSE, str(loud)),
                            dllogger.JSONStreamBackend(dllogger.Verbosity.OFF, str(off)),
                            dllogger.StdOutBackend(dllogger.Verbosity.DEFAULT)])
    dllogger.metadata("a", {})
    dllogger.log(step=1, data={"a": 1})
    dllogger.log(step=2, data={"a": 2}, verbosity=dllogger.Verbosity.VERBOSE)
    dllogger.flush()
    assert [r.get("step") for r in read_records(quiet)] == [None, 1]
    assert [r.get("step") for r in read_records(loud)] == [None, 1, 2]
    assert off.read_text() == ""
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].endswith(" - 1 a : 1")


def test_stdout_line_uses_metadata_format_and_unit(capsys):
    dllogger.init(backends=[dllogger.StdOutBackend(dllogger.Verbosity.VERBOSE)])
    dllogger.metadata("loss", {"unit": "nats", "format": ":.3f"})
    dllogger.log(step=(0, 7), data={"loss": 1.23456, "lr": 0.5})
    line = capsys.readouterr().out.strip()
    prefix, rest = line.split(" - ", 1)
    assert prefix.startswith("DLL ") and datetime.fromisoformat(prefix[4:])
    assert rest == "(0, 7) loss : 1.235 nats lr : 0.5"


def test_custom_step_format_and_append(tmp_path, capsys):
    path = tmp_path / "log.json"
    path.write_text('DLLL {"type": "LOG", "step": [], "data": {}}\n')
    dllogger.init(backends=[
        dllogger.JSONStreamBackend(dllogger.Verbosity.DEFAULT, str(path), append=True),
        dllogger.StdOutBackend(dllogger.Verbosity.DEFAULT, step_format=lambda s: f"epoch {s[0]} step {s[1]}")])
    dllogger.log(step=(2, 3), data={"x": 1})
    dllogger.flush()
    assert [r["step"] for r in read_records(path)] == [[], [2, 3]]
    assert "epoch 2 step 3 x : 1" in capsys.readouterr().out


def test_default_formats():
    assert dllogger.default_step_format((1, 2)) == "(1, 2)"
    assert dllogger.default_metric_format("t", {"unit": "s", "format": ":.2f"}, 0.123) == "t : 0.12 s"
    assert dllogger.default_metric_format("n", {}, 3) == "n : 3"


def test_custom_backend_receives_records():
    class Collect(dllogger.Backend):
        def __init__(self):
            super().__init__(dllogger.Verbosity.VERBOSE)
            self.calls = []

        def log(self, timestamp, elapsedtime, step, data):
            self.calls.append(("log", step, data))

        def metadata(self, timestamp, elapsedtime, metric, metadata):
            self.calls.append(("metadata", metric, metadata))

        def flush(self):
            self.calls.append(("flush",))

    backend = Collect()
    logger = dllogger.Logger([backend])
    logger.metadata("m", {"unit": "u"})
    logger.log(step=3, data={"m": 1.0})
    logger.flush()
    assert backend.calls == [("metadata", "m", {"unit": "u"}), ("log", 3, {"m": 1.0}), ("flush",)]
    with pytest.raises(TypeError):
        dllogger.Backend(dllogger.Verbosity.DEFAULT)


def test_log_before_init_and_double_init_raise(tmp_path):
    with pytest.raises(dllogger.DLLoggerNotInitialized):
        dllogger.log(step=1, data={})
    dllogger.init(backends=[])
    with pytest.raises(dllogger.DLLLoggerAlreadyInitialized):
        dllogger.init(backends=[])
