"""End to end through Hydra, as a user runs it: sweeps, isolation, forced OOM, and bad input on the command line."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.config import RunConfig
from harness.store import disk
from tests.greedy import LOGIT_TOL, assert_no_near_tie, point_logits
from tests.run import cli_runs

ROOT = Path(__file__).parents[2]
# Quick ceilings, measured once for the whole session and reused by every sweep here.
CEILINGS = Path(tempfile.gettempdir()) / "kvbench-test-ceilings"
TINY = [
    "model=tiny",
    "gen_len=6",
    "warmup=0",
    "min_repeats=2",
    "max_repeats=2",
    "ceilings_quick=true",
    f"ceilings_dir={CEILINGS}",
    "retry_noisy=false",  # two repeats never converge: a retry would double every test point for nothing
]

pytestmark = pytest.mark.slow


def kvbench(*overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.decode", *(["-m"] if multirun else []), *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_fp32_multirun_gives_identical_output_digests_across_strategies(tmp_path):
    proc = kvbench(
        *TINY,
        "dtype=fp32",
        "profile=false",  # digests are the point here; the profiler has tests of its own
        "batch_size=1,3",
        "prompt_len=19",
        "cache=none,contiguous,paged",
        f"results_dir={tmp_path}",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr
    table = disk.load(tmp_path)
    assert len(table) == 6 and (table["status"] == "ok").all()
    assert table["sweep_id"].nunique() == 1
    for _, group in table.groupby("batch_size"):
        # Recomputation and the caches run other GEMM shapes: equal digests are owed only where rounding cannot flip
        # a greedy choice (tests/greedy.py).
        assert_no_near_tie(point_logits(RunConfig(**json.loads(group["config_json"].iloc[0]))), tol=LOGIT_TOL["fp32"])
        assert group["output_digest"].nunique() == 1, group[["cache", "output_digest"]]
    assert "6 points" in proc.stdout and "0 not ok" in proc.stdout


def test_contiguous_allocation_equals_the_prediction_and_paged_live_follows_the_formula(tmp_path):
    proc = kvbench(
        *TINY,
        "dtype=fp32",
        "profile=false",  # KV bytes are the point here; the profiler has tests of its own
        "batch_size=2",
        "prompt_len=21",
        "cache=contiguous,paged",
        f"results_dir={tmp_path}",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr
    table = disk.load(tmp_path).set_index("cache")
    contiguous, paged = table.loc["contiguous"], table.loc["paged"]
    assert contiguous["kv_bytes_allocated"] == contiguous["kv_bytes_predicted"]
    assert (table["kv_bytes_planner"] == table["kv_bytes_allocated"]).all()  # the planner, written by the run
    per_token = contiguous["kv_bytes_predicted"] / (2 * (21 + 6))  # batch x (prompt + gen) tokens
    assert paged["kv_bytes_live"] == 2 * (21 + 6 - 1) * per_token
    assert paged["block_size"] == 16 and pd.isna(contiguous["block_size"])


def test_a_forced_oom_is_a_row_and_the_sweep_finishes(tmp_path):
    # A 1 GiB cap: batch 1 fits; batch 4096 needs ~2.2 GB of KV alone and runs out of memory in its own process.
    proc = kvbench(
        *TINY,
        "prompt_len=1024",
        "batch_size=4096,1",
        "cache=contiguous",
        "max_memory_gb=1.0",
        f"results_dir={tmp_path}",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr
    table = disk.load(tmp_path).set_index("batch_size")
    assert table.loc[4096, "status"] == "oom"
    assert "allocate" in table.loc[4096, "error"]
    assert table.loc[1, "status"] == "ok"
    assert "1 not ok" in proc.stdout


def test_an_exhausted_paged_pool_is_an_oom_row(tmp_path):
    proc = kvbench(
        *TINY, "prompt_len=40", "batch_size=2", "cache=paged", "cache.pool_tokens=32", f"results_dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = disk.load(tmp_path).to_dict("records")
    assert row["status"] == "oom" and "exhausted" in row["error"]


def test_a_single_run_prints_its_summary(tmp_path):
    proc = kvbench(*TINY, "prompt_len=8", "isolate=false", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "tpot ms" in proc.stdout and "tiny" in proc.stdout
    assert len(disk.load(tmp_path)) == 1
    (run_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert proc.stdout.splitlines()[-1].endswith(f" show {run_dir})")  # the next step: kvbench-results show


BAD_INPUT = [
    ("model=gpt-5", "Could not find 'model/gpt-5'"),  # Hydra's own check lists the available options
    ("model.name=gpt-5", "model: unknown preset 'gpt-5'; allowed:"),
    ("cache.name=lru", "cache: unknown strategy 'lru'; allowed:"),
    ("dtype=fp64", "dtype: unknown value 'fp64'; allowed: fp32, fp16, bf16"),
    ("batch_size=0", "batch_size: must be positive"),
    ("prompt_len=8190", "prompt_len + gen_len: 8196 exceeds tiny's 8192 positions"),
    ("weights=/does/not/exist", "weights: '/does/not/exist' is neither 'dummy' nor an existing directory"),
]
BAD_SWEEP = ["-m", *TINY, "batch_size=1,0"]  # a multirun with one bad point


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Each bad command line's exit status, stdout and stderr, and its own results_dir: all run in one spawned
    interpreter (tests/run/cli_runs.py), each through experiments.decode as `python -m` runs it, so that the
    refusals cost one interpreter, torch and Hydra start, not one each. Keyed by the bad override ("sweep": the
    multirun)."""
    base = tmp_path_factory.mktemp("refused")
    cases = {override: [*TINY, override] for override, _ in BAD_INPUT} | {"sweep": BAD_SWEEP}
    dirs = {key: base / f"case-{i}" for i, key in enumerate(cases)}
    argvs = [[*argv, f"results_dir={dirs[key]}"] for key, argv in cases.items()]
    return {key: (run, dirs[key]) for key, run in zip(cases, cli_runs.spawn(argvs), strict=True)}


@pytest.mark.parametrize(("override", "message"), BAD_INPUT)
def test_bad_input_fails_with_one_line_and_records_nothing(refused, override, message):
    run, results_dir = refused[override]
    assert run["returncode"] != 0
    assert message in run["stderr"]
    assert not list(results_dir.rglob("*.parquet"))


def test_a_bad_point_in_a_sweep_stops_it_before_anything_is_measured(refused):
    run, results_dir = refused["sweep"]
    assert run["returncode"] == 2
    assert "bad config: sweep point [" in run["stderr"] and "batch_size: must be positive, got 0" in run["stderr"]
    assert not list(results_dir.rglob("*.parquet"))


def broken_checkpoint(checkpoint: Path) -> Path:
    """A checkpoint that passes the cheap up-front checks (a llama config.json, a .safetensors file) but cannot be
    loaded: its point runs and fails inside the measuring process."""
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, '
        '"num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 128}'
    )
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    return checkpoint


def test_a_point_that_crashes_is_an_error_row_with_its_message(tmp_path):
    checkpoint = broken_checkpoint(tmp_path / "broken-llama")
    out = tmp_path / "results"
    proc = kvbench(*TINY, "prompt_len=8", f"weights={checkpoint}", f"results_dir={out}")
    assert proc.returncode == 0, proc.stderr
    (row,) = disk.load(out).to_dict("records")
    assert row["status"] == "error" and row["error"]
    assert row["model"] == "broken-llama" and row["tpot_ms"] != row["tpot_ms"]  # NaN: nothing was measured


def _running(process) -> bool:
    """Running or sleeping: neither gone nor a zombie."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killing_the_sweep_kills_its_measuring_child():
    import psutil

    script = (
        "from harness.config import RunConfig; from harness.run.runner import run_point; "
        "run_point(RunConfig(model={'name': 'small'}, dtype='fp32', prompt_len=512, gen_len=64, min_repeats=20))"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        children = []
        for _ in range(300):  # up to 30 s for the spawned child to appear
            children = psutil.Process(parent.pid).children()
            if children:
                break
            time.sleep(0.1)
        assert children, "no measuring child was spawned"
        time.sleep(3)  # let it get going: killed mid-import it must die too, but that is the easy case
        parent.kill()
        parent.wait()
        # A child still importing (torch, transformers) sets its parent-death signal only once it reaches the
        # worker's main, then sees its parent gone and exits: on 2 cores busy with the rest of the suite that
        # import alone has taken over 15 s, hence 60.
        _, alive = psutil.wait_procs(children, timeout=60)
        # A zombie has exited (no CPU, no memory) and waits for whoever inherited it to reap it; a container's PID 1
        # may take its time.
        alive = [p for p in alive if _running(p)]
        assert not alive, "the measuring child outlived the sweep"
    finally:
        parent.kill()
        for child in children:  # a failed run leaves nothing behind to load the rest of the suite
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_the_strategies_experiment_writes_a_row_for_every_combination(tmp_path):
    # Every strategy against two formats (the exact one and 8-bit) on the tiny preset: the sweep's plumbing and the
    # strategies' rows, not the small preset's prefills (3 minutes of this suite). int4 needs a kv_group_size (32 or
    # 64) dividing head_dim, which tiny's 16 is not: its layouts are tests/kv/test_quant.py's and test_kv.py's. The full
    # 6 x 6 sweep on small is results/reference/cpu-strategies/.
    proc = kvbench(
        "experiment=strategies",
        "hydra.sweeper.params.kv_dtype='auto,int8'",
        "model=tiny",
        "profile=false",  # rows and their accuracy are the point here; the profiler has tests of its own
        "ceilings_quick=true",
        f"ceilings_dir={CEILINGS}",
        "prompt_len=144",
        "batch_size=1",  # half the prefill work of the preset's 2; the prefix is still computed once and shared
        "gen_len=4",
        "warmup=0",
        "min_repeats=1",
        "max_repeats=1",
        "retry_noisy=false",  # one repeat never converges; a retry would only add a prefill per point
        "isolate=false",
        f"results_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    table = disk.load(tmp_path)
    assert len(table) == 6 * 2  # every strategy x every kv_dtype asked for: no missing rows
    assert set(table["status"]) <= {"ok", "unsupported"}, table.loc[table["status"] != "ok", ["cache", "error"]]
    unsupported = table[table["status"] == "unsupported"]
    assert unsupported["error"].str.len().gt(10).all()  # each says why
    assert set(unsupported.loc[unsupported["cache"] == "offload", "kv_dtype"]) == set(table["kv_dtype"])  # no CUDA
    ok = table[table["status"] == "ok"].set_index(["cache", "kv_dtype"])
    exact = ok.xs("fp32", level="kv_dtype")["output_digest"]
    # Recomputation, the caches and the prefix's batch-1 pass run other GEMM shapes (and, on CUDA, int8 contiguous
    # and paged other kernels): equal digests are owed only where rounding cannot flip a greedy choice.
    for kv_dtype in ("fp32", "int8"):
        point = RunConfig(**json.loads(ok.loc[("contiguous", kv_dtype), "config_json"]))
        assert_no_near_tie(point_logits(point), tol=LOGIT_TOL[kv_dtype])
    assert exact["none"] == exact["contiguous"] == exact["paged"] == exact["prefix"]
    # the same storage math, whatever the layout
    assert ok.loc[("contiguous", "int8"), "output_digest"] == ok.loc[("paged", "int8"), "output_digest"]
    lossy = ok[ok.index.get_level_values("kv_dtype") != "fp32"]
    assert lossy[["logit_max_abs_err", "kl_mean", "top1_agreement"]].notna().all().all()
    assert ok.loc[("sliding", "fp32"), "top1_agreement"] > 0  # past its window: lossy, so measured
    ratio = ok.loc[("contiguous", "int8"), "kv_bytes_allocated"] / ok.loc[("contiguous", "fp32"), "kv_bytes_allocated"]
    head_dim = 16  # the tiny preset's: 1 byte a value plus a 4-byte scale per token and head, against 4 bytes
    assert ratio == pytest.approx((head_dim + 4) / (4 * head_dim))
