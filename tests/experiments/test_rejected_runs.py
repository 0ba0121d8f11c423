"""A rejected config leaves nothing behind (issue #27 item 8): Hydra makes the job's folder (.hydra/, <job>.log)
before an entry point can check its input, and harness.errors.remove_rejected_run takes it back; a run whose
combination is unsupported after validation is the same one line (item 10). Each case is the entry point as
`python -m` runs it (runpy, as __main__, its own sys.argv), against an empty results_dir of its own; all of them in
one spawned interpreter (tests/run/cli_runs.py), which pays torch's and Hydra's start once, not 19 times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run import cli_runs

SERVE_TINY = ["model=tiny", "max_model_len=64", "kv_memory_gb=0.01", "num_prompts=2", "prompt_len=16", "output_len=4"]


def command_line(module: str, results_dir: Path, *overrides: str) -> dict:
    """One case for tests/run/cli_runs.py: Hydra's flags (-m) before the overrides, as argparse wants them."""
    flags = [o for o in overrides if o == "-m"]
    return {"module": module, "argv": [*flags, f"results_dir={results_dir}", *(o for o in overrides if o != "-m")]}


def last_line(result: dict) -> str:
    return result["stderr"].strip().splitlines()[-1]


# Case id -> (entry point, overrides, what its one line says)
REJECTED = {
    "decode": ("experiments.decode", ["dtype=fp64"], "dtype: unknown value 'fp64'"),
    "decode-multirun": ("experiments.decode", ["-m", "dtype=fp32,fp64"], "dtype=fp64]: dtype: unknown value"),
    "serve": ("experiments.serve", [*SERVE_TINY, "tpot_slo_ms=fast"], "tpot_slo_ms: 'fast' is not a duration"),
    "serve-multirun": (
        "experiments.serve",
        ["-m", *SERVE_TINY, "tpot_slo_ms=fast,1s"],
        "tpot_slo_ms: 'fast' is not a duration",
    ),
    "serve-mla": (
        "experiments.serve",
        [*SERVE_TINY, "model=mla-tiny", "strategy=sliding", "sliding_window=8"],
        "strategy: mla-tiny is MLA",
    ),
    "serve-sharegpt-dummy": (
        "experiments.serve",
        [*SERVE_TINY, "dataset=sharegpt"],
        "dataset: sharegpt needs a tokenizer",
    ),
    "serve-multiturn-max-turns": (
        "experiments.serve",
        [*SERVE_TINY, "dataset=sharegpt-multiturn", "max_turns=0"],
        "max_turns: must be an",
    ),
    "serve-multiturn-think-time": (
        "experiments.serve",
        [*SERVE_TINY, "dataset=sharegpt-multiturn", "think_time_s=-1"],
        "think_time_s: must",
    ),
    "serve-tier-host-gb": (
        "experiments.serve",
        [*SERVE_TINY, "strategy=prefix", "cache.host_gb=-1"],
        "cache.host_gb: must be 0",
    ),
    "serve-tier-not-prefix": (
        "experiments.serve",
        [*SERVE_TINY, "cache.host_gb=1"],
        "cache.host_gb: only strategy=prefix keeps",
    ),
    "serve-tier-disk-dir": (
        "experiments.serve",
        [*SERVE_TINY, "strategy=prefix", "cache.disk_dir=/proc/kv"],
        "cache.disk_dir: /proc",
    ),
    "decode-gguf-missing": ("experiments.decode", ["weights=/nonexistent/model.gguf"], "weights: "),
    "pd": ("experiments.pd", ["kv_dtypes=[bogus]"], "kv_dtypes: unknown 'bogus'"),
    "tiers": ("experiments.tiers", ["block_tokens=[0]"], "block_tokens: must be a non-empty list"),
    "capacity": ("experiments.capacity", ["mode=bogus"], "mode: unknown value 'bogus'"),
    "ceilings": ("experiments.ceilings", ["device=bogus"], "device: unknown value 'bogus'"),
}
MULTITURN = {
    "no-whole-record": ('[{"id": "c0", "conversations": [{"from": "human", "val', "holds no whole conversation"),
    "every-one-filtered": (
        '[{"id": "c0", "conversations": [{"from": "human", "value": "w1 w2"}]}]',
        "dataset: every one of 1 conversations is filtered out",
    ),
}


@pytest.fixture(scope="module")
def rejected(tmp_path_factory, llama_checkpoint) -> dict[str, tuple[dict, Path]]:
    """Case id -> (its exit status, stdout and stderr; its results_dir), every case run in one interpreter."""
    base = tmp_path_factory.mktemp("rejected")
    lines, dirs = [], {}
    for key, (module, overrides, _) in REJECTED.items():
        dirs[key] = base / key
        lines.append(command_line(module, dirs[key], *overrides))
    for key, (records, _) in MULTITURN.items():
        path = base / f"{key}.json"
        path.write_text(records)
        dirs[key] = base / key
        lines.append(command_line("experiments.serve", dirs[key], *SERVE_TINY, "dataset=sharegpt-multiturn",
                                  f"dataset_path={path}", f"weights={llama_checkpoint}"))  # fmt: skip
    dirs["sweep"] = base / "sweep"
    lines.append(command_line("experiments.capacity", dirs["sweep"], "-m", "mode=plan,bogus"))
    for directory in dirs.values():
        directory.mkdir()  # each case's empty results_dir
    return {key: (run, dirs[key]) for key, run in zip(dirs, cli_runs.spawn(lines), strict=True)}


def files_in(results_dir: Path) -> list[str]:
    return sorted(p.relative_to(results_dir).as_posix() for p in results_dir.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("case", REJECTED)
def test_a_rejected_config_is_one_line_and_leaves_no_folder(rejected, case):
    result, results_dir = rejected[case]
    message = REJECTED[case][2]
    assert result["returncode"] == 2, result["stderr"][-3000:]
    assert last_line(result).startswith("kvbench: bad config: ") and message in last_line(result)
    assert "Traceback" not in result["stderr"]
    assert files_in(results_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", MULTITURN)
def test_a_multiturn_dataset_with_no_session_is_one_line_and_leaves_no_folder(rejected, case):
    """Each one line from plan(), after the config's checks and before the model is built."""
    result, results_dir = rejected[case]
    assert result["returncode"] == 2, result["stderr"][-3000:]
    assert last_line(result).startswith("kvbench: bad config: ") and MULTITURN[case][1] in last_line(result)
    assert files_in(results_dir) == []


@pytest.mark.slow
def test_a_sweep_stopped_by_a_rejected_job_keeps_the_jobs_before_it(rejected):
    result, results_dir = rejected["sweep"]
    assert result["returncode"] == 2 and "mode: unknown value 'bogus'" in last_line(result)
    (sweep,) = (results_dir / "capacity" / "runs").iterdir()
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]  # job 1's folder is gone
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file() and (sweep / "0" / "capacity.log").is_file()
