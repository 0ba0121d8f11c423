"""A rejected config leaves nothing behind (issue #27 item 8): Hydra makes the job's folder (.hydra/, <job>.log)
before an entry point can check its input, and harness.errors.remove_rejected_run takes it back; a run whose
combination is unsupported after validation is the same one line (item 10). Each case is the entry point in a
fresh process, as a user runs it, against an empty results_dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVE_TINY = ["model=tiny", "max_model_len=64", "kv_memory_gb=0.01", "num_prompts=2", "prompt_len=16", "output_len=4"]


def run(module: str, results_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    flags = [o for o in overrides if o == "-m"]  # argparse: Hydra's flags before the overrides
    command = [sys.executable, "-m", module, *flags, f"results_dir={results_dir}", *(o for o in overrides if o != "-m")]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "overrides", "message"),
    [
        ("experiments.decode", ["dtype=fp64"], "dtype: unknown value 'fp64'"),
        ("experiments.decode", ["-m", "dtype=fp32,fp64"], "dtype=fp64]: dtype: unknown value"),
        ("experiments.serve", [*SERVE_TINY, "tpot_slo_ms=fast"], "tpot_slo_ms: 'fast' is not a duration"),
        ("experiments.serve", ["-m", *SERVE_TINY, "tpot_slo_ms=fast,1s"], "tpot_slo_ms: 'fast' is not a duration"),
        (
            "experiments.serve",
            [*SERVE_TINY, "model=mla-tiny", "strategy=sliding", "sliding_window=8"],
            "strategy: mla-tiny is MLA",
        ),
        ("experiments.serve", [*SERVE_TINY, "dataset=sharegpt"], "dataset: sharegpt needs a tokenizer"),
        ("experiments.serve", [*SERVE_TINY, "dataset=sharegpt-multiturn", "max_turns=0"], "max_turns: must be an"),
        ("experiments.serve", [*SERVE_TINY, "dataset=sharegpt-multiturn", "think_time_s=-1"], "think_time_s: must"),
        ("experiments.serve", [*SERVE_TINY, "strategy=prefix", "cache.host_gb=-1"], "cache.host_gb: must be 0"),
        ("experiments.serve", [*SERVE_TINY, "cache.host_gb=1"], "cache.host_gb: only strategy=prefix keeps"),
        ("experiments.serve", [*SERVE_TINY, "strategy=prefix", "cache.disk_dir=/proc/kv"], "cache.disk_dir: /proc"),
        ("experiments.decode", ["weights=/nonexistent/model.gguf"], "weights: "),
        ("experiments.pd", ["kv_dtypes=[bogus]"], "kv_dtypes: unknown 'bogus'"),
        ("experiments.tiers", ["block_tokens=[0]"], "block_tokens: must be a non-empty list"),
        ("experiments.capacity", ["mode=bogus"], "mode: unknown value 'bogus'"),
        ("experiments.ceilings", ["device=bogus"], "device: unknown value 'bogus'"),
    ],
    ids=[
        "decode",
        "decode-multirun",
        "serve",
        "serve-multirun",
        "serve-mla",
        "serve-sharegpt-dummy",
        "serve-multiturn-max-turns",
        "serve-multiturn-think-time",
        "serve-tier-host-gb",
        "serve-tier-not-prefix",
        "serve-tier-disk-dir",
        "decode-gguf-missing",
        "pd",
        "tiers",
        "capacity",
        "ceilings",
    ],  # fmt: skip
)
def test_a_rejected_config_is_one_line_and_leaves_no_folder(tmp_path, module, overrides, message):
    result = run(module, tmp_path, *overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result).startswith("kvbench: bad config: ") and message in last_line(result)
    assert "Traceback" not in result.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("records", "overrides", "message"),
    [
        ('[{"id": "c0", "conversations": [{"from": "human", "val', [], "holds no whole conversation"),
        ('[{"id": "c0", "conversations": [{"from": "human", "value": "w1 w2"}]}]', [],
         "dataset: every one of 1 conversations is filtered out"),
    ],
    ids=["no-whole-record", "every-one-filtered"],
)  # fmt: skip
def test_a_multiturn_dataset_with_no_session_is_one_line_and_leaves_no_folder(
    tmp_path, tmp_path_factory, llama_checkpoint, records, overrides, message
):
    """Each one line from plan(), after the config's checks and before the model is built."""
    path = tmp_path_factory.mktemp("dataset") / "chats.json"
    path.write_text(records)
    result = run("experiments.serve", tmp_path, *SERVE_TINY, "dataset=sharegpt-multiturn", f"dataset_path={path}",
                 f"weights={llama_checkpoint}", *overrides)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result).startswith("kvbench: bad config: ") and message in last_line(result)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == []


@pytest.mark.slow
def test_a_sweep_stopped_by_a_rejected_job_keeps_the_jobs_before_it(tmp_path):
    result = run("experiments.capacity", tmp_path, "-m", "mode=plan,bogus")
    assert result.returncode == 2 and "mode: unknown value 'bogus'" in last_line(result)
    (sweep,) = (tmp_path / "capacity" / "runs").iterdir()
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]  # job 1's folder is gone
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file() and (sweep / "0" / "capacity.log").is_file()
