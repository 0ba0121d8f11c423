"""make bench-serve end to end on the tiny preset: both engines serve the same stream, each run is written as a
serving run, and the table says the ratio and that every request made the same tokens in both (fp32)."""

from __future__ import annotations

import pytest

from experiments import bench_serve
from harness.serve.rows import load_run


def test_bench_serve_prints_both_engines_the_ratio_and_equal_tokens(tmp_path, capsys):
    bench_serve.main(["--model", "tiny", "--num-prompts", "6", "--prompt-len", "20", "--output-len", "8",
                      "--spread", "0.5", "--num-blocks", "64", "--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                      "--results-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "ours / theirs: output tok/s" in out
    assert "same tokens: 6/6 requests in every round" in out
    assert "kvbench scheduler at 4 running: " in out  # issue #16 item 11's figure, at max_num_seqs running
    runs = sorted((tmp_path / "serve").iterdir())
    assert len(runs) == 2  # one per engine
    engines = set()
    for run in runs:
        requests, _, row = load_run(run)
        assert len(requests) == 6 and (requests["output_len"] >= 4).all()
        engines.add(row["engine"])
        assert (row["max_num_seqs"], row["max_num_batched_tokens"], row["block_size"]) == (4, 32, 8)
    assert engines == {"kvbench", "transformers-cb"}


def test_a_pool_past_the_machine_is_one_line_before_any_engine_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve.main(["--model", "tiny", "--num-blocks", str(10**12), "--results-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbench: bad config: --num-blocks: a KV pool of ") and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_an_mla_model_is_refused_in_one_line_before_any_engine_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve.main(["--model", "mla-tiny", "--results-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("kvbench: bad config: --model: mla-tiny is MLA")
    assert list(tmp_path.iterdir()) == []
