"""Every row says where, with what and how it was measured, and two rows can be diffed to see what changed."""

from __future__ import annotations

import json
import platform

import torch

from harness import bench, results
from harness.config import RunConfig


def test_environment_columns_name_the_machine_and_the_software():
    columns = bench.environment_columns(torch.device("cpu"))
    assert columns["python_version"] == platform.python_version()
    assert columns["torch_version"] == torch.__version__
    assert columns["device_count"] == 1 and columns["cuda_version"] is None and columns["driver_version"] is None
    assert columns["cpu_model"] and columns["host"]
    assert isinstance(columns["git_dirty"], bool) and len(columns["git_sha"]) == 40  # this is a git checkout
    assert columns["kvbench_version"]


def test_config_json_is_the_resolved_config():
    cfg = RunConfig(model={"name": "tiny"}, batch_size=3, cache={"name": "paged", "block_size": 32})
    config = json.loads(bench.config_columns(cfg)["config_json"])
    assert config["batch_size"] == 3 and config["cache"] == {"name": "paged", "block_size": 32}
    assert config["model"]["name"] == "tiny"


def test_diff_lists_what_changed_between_two_rows(tmp_path, capsys):
    for batch_size, point in ((1, "aaaa1111"), (4, "bbbb2222")):
        cfg = RunConfig(model={"name": "tiny"}, batch_size=batch_size)
        row = bench.config_columns(cfg) | bench.environment_columns(torch.device("cpu"))
        results.write_point(row | {"point_id": point, "sweep_id": "s", "status": "ok"}, tmp_path)
    assert results.main(["diff", str(tmp_path), "aaaa", "bbbb"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "batch_size: 1 -> 4" in out and "config.batch_size: 1 -> 4" in out
    assert "point_id: aaaa1111 -> bbbb2222" in out
    assert not any(line.startswith(("model:", "config.dtype")) for line in out)
    assert results.main(["diff", str(tmp_path), "aaaa", "aaaa1111"]) == 0
    assert capsys.readouterr().out.strip() == "no differences"
    assert results.main(["diff", str(tmp_path), "zzzz", "aaaa"]) == 2
