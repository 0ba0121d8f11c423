"""Every row says where, with what and how it was measured, and two rows can be diffed to see what changed."""

from __future__ import annotations

import json
import logging
import math
import platform
import sys
import types

import pandas as pd
import pytest
import torch

from harness.config import RunConfig
from harness.device import ceilings
from harness.measure import environment, nvml
from harness.run import point
from harness.store import cli, diff, disk


def test_environment_columns_name_the_machine_and_the_software():
    columns = environment.environment_columns(torch.device("cpu"))
    assert columns["python_version"] == platform.python_version()
    assert columns["torch_version"] == torch.__version__
    assert columns["device_count"] == 1 and columns["cuda_version"] is None and columns["driver_version"] is None
    assert columns["cpu_model"] and columns["host"]
    assert columns["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256")  # ATen's names
    assert isinstance(columns["git_dirty"], bool) and len(columns["git_sha"]) == 40  # this is a git checkout
    assert columns["kvbench_version"]


def test_config_json_is_the_resolved_config():
    cfg = RunConfig(model={"name": "tiny"}, batch_size=3, cache={"name": "paged", "block_size": 32})
    config = json.loads(point.config_columns(cfg)["config_json"])
    assert config["batch_size"] == 3 and config["cache"] == {"name": "paged", "block_size": 32}
    assert config["model"]["name"] == "tiny"


def test_diff_lists_what_changed_between_two_rows(tmp_path, capsys):
    for batch_size, point_id in ((1, "aaaa1111"), (4, "bbbb2222")):
        cfg = RunConfig(model={"name": "tiny"}, batch_size=batch_size)
        row = point.config_columns(cfg) | environment.environment_columns(torch.device("cpu"))
        disk.write_point(row | {"point_id": point_id, "sweep_id": "s", "status": "ok"}, tmp_path)
    assert cli.main(["diff", str(tmp_path), "aaaa", "bbbb"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "batch_size: 1 -> 4" in out and "config.batch_size: 1 -> 4" in out
    assert "point_id: aaaa1111 -> bbbb2222" in out
    assert not any(line.startswith(("model:", "config.dtype")) for line in out)
    assert cli.main(["diff", str(tmp_path), "aaaa", "aaaa1111"]) == 0
    assert capsys.readouterr().out.strip() == "no differences"
    assert cli.main(["diff", str(tmp_path), "zzzz", "aaaa"]) == 2


def test_config_json_round_trips_to_the_same_run_config():
    cfg = RunConfig(model={"name": "tiny", "n_kv_heads": 1}, batch_size=2, cache={"name": "paged", "block_size": 16})

    assert RunConfig(**json.loads(point.config_columns(cfg)["config_json"])) == cfg


def test_config_json_is_strict_json_even_for_an_infinite_budget():
    cfg = RunConfig(model={"name": "tiny"}, max_time_s=math.inf)

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(point.config_columns(cfg)["config_json"], parse_constant=refuse)["max_time_s"] == "inf"


def test_the_new_columns_are_written_and_read_back_with_their_types(tmp_path):
    cfg = RunConfig(model={"name": "tiny"})
    row = point.config_columns(cfg) | environment.environment_columns(torch.device("cpu")) | {"status": "ok"}
    disk.write_point(row, tmp_path)

    loaded = disk.load(tmp_path).iloc[0]

    for name in (
        "git_dirty",
        "cpu_model",
        "cpu_capability",
        "device_count",
        "python_version",
        "kvbench_version",
        "config_json",
    ):
        assert loaded[name] == row[name], name
    assert pd.isna(loaded["driver_version"]) and pd.isna(loaded["cuda_version"])


@pytest.mark.parametrize("failure", ["absent", "init fails"])
def test_no_nvml_leaves_the_driver_version_null(monkeypatch, failure):
    if failure == "absent":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    else:
        broken = types.ModuleType("pynvml")
        broken.nvmlInit = lambda: (_ for _ in ()).throw(OSError("NVML Shared Library Not Found"))
        monkeypatch.setitem(sys.modules, "pynvml", broken)
    environment.nvidia_driver_version.cache_clear()
    try:
        assert environment.nvidia_driver_version() is None
    finally:
        environment.nvidia_driver_version.cache_clear()


def write_run(directory, point_id, started_at, batch_size=1):
    cfg = RunConfig(model={"name": "tiny"}, batch_size=batch_size)
    row = point.config_columns(cfg) | environment.environment_columns(torch.device("cpu"))
    row |= {"point_id": point_id, "sweep_id": "s", "status": "ok", "started_at": started_at}
    disk.write_point(row, directory)


def test_diff_takes_the_latest_run_of_a_point_and_says_so(tmp_path, capsys, caplog):
    write_run(tmp_path / "first", "aaaa1111", "2026-12-01T00:00:00+00:00", batch_size=1)
    write_run(tmp_path / "second", "aaaa1111", "2026-12-01T01:00:00+00:00", batch_size=2)
    write_run(tmp_path, "bbbb2222", "2026-12-01T01:00:00+00:00", batch_size=2)
    caplog.set_level(logging.INFO, logger=diff.__name__)

    assert cli.main(["diff", str(tmp_path), "aaaa", "bbbb"]) == 0

    assert capsys.readouterr().out.splitlines() == ["point_id: aaaa1111 -> bbbb2222"]
    assert "measured 2 times" in caplog.text and "2026-12-01T01:00:00" in caplog.text


def test_diff_refuses_an_ambiguous_prefix_and_prefers_an_exact_id(tmp_path, caplog):
    write_run(tmp_path, "abc", "2026-12-01T00:00:00+00:00")
    write_run(tmp_path, "abcd", "2026-12-01T00:00:00+00:00", batch_size=2)

    assert cli.main(["diff", str(tmp_path), "ab", "abcd"]) == 2
    assert "a: 'ab' matches 2 points" in caplog.text
    assert cli.main(["diff", str(tmp_path), "abc", "abcd"]) == 0


def test_the_driver_version_comes_through_the_nvml_seam(monkeypatch):
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: b"550.54.15"
    )
    monkeypatch.setattr(nvml, "load_nvml", lambda: fake)
    environment.nvidia_driver_version.cache_clear()
    try:
        assert environment.nvidia_driver_version() == "550.54.15"
    finally:
        environment.nvidia_driver_version.cache_clear()


def test_the_ceilings_name_the_cpu_as_the_rows_cpu_model_does():
    assert ceilings.device_name(torch.device("cpu")) == environment.cpu_model()
    assert environment.environment_columns(torch.device("cpu"))["device_name"] == environment.cpu_model()
