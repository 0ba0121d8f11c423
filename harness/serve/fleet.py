"""The consumers of a saturation sweep (issue #16 item 8, experiment=serve-qps): each strategy's knee, and the fleet
that serves a target rate from it.

A sweep is the serving runs that share a sweep_id, each one run.parquet under <results_dir>/serve/<run_id>/
(harness.serve.rows); a run killed midway has no run.parquet and is not one of them. Per (strategy, kv_dtype,
engine), the runs' qps points make a curve, and from it:

    knee_qps       measured    the highest qps whose p99 TTFT stays within the SLO, every point up to it sustained
                               (harness.serve.metrics.knee; harness.serve.sustained: the achieved rate within 5% of
                               the offered one over the measured window, the run's SLO attainment met): a finite
                               stream lets a saturated server finish inside a loose SLO, and such a point is no knee
    replicas       measured    ceil(target_qps / knee_qps): replicas each loaded at or below the knee
                               (harness.serve.budget.replicas_needed)
    predicted_concurrency      target_qps x the knee run's mean E2E latency: the requests in flight across the fleet,
                   predicted   on average, by Little's law (harness.serve.budget.concurrency_needed). Per replica it
                               sits beside the knee run's measured max_concurrent_requests, the most in flight at once
                               (both count queueing): a mean beside a peak, at a rate at or below the knee's, so it
                               should not exceed it. The knee run's max_running_requests (queueing left out) is shown
                               too: what the replica's KV pool held at once

Runs at qps=inf (all requests at t = 0) are a burst, not a rate: they are left out of the curve. A run row written
before the sustained verdict has it recomputed from its request rows (harness.serve.rows.read_run_table); without
them it is unknown, which is not sustained, and the refusal says so. Torch-free (pandas and pyarrow), so that the
dashboard can read a sweep without the model; fleet() alone imports the planner's module.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from numbers import Real
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from harness.errors import ConfigError
from harness.serve.columns import FLEET_COLUMNS, KNEE_ROW_COLUMNS
from harness.serve.metrics import MS_PER_S, SLO_FORMS, knee, parse_slo_ms
from harness.serve.rows import RUN_FILE, SERVE_DIR, read_run_table
from harness.store.disk import FLEET_PREFIX, write_parquet
from harness.store.schema import arrow_fields

CURVE_KEY = ("strategy", "kv_dtype", "engine")  # one curve, one knee
KNEE_METRIC = "p99_ttft_ms"  # issue #16 item 8: "the highest qps whose TTFT p99 stays under the SLO"
# The timestamp a sweep_id carries: Hydra's ${now:%Y%m%d-%H%M%S}, the name of the sweep's folder. Fixed width, so
# its text sorts as its time does; the sweep_id's own text may not (a prefix such as "bench-" sorts after digits).
_SWEEP_STAMP = re.compile(r"\d{8}-\d{6}")

# What a curve's knee is, when it has one: "knee", a point above it broke the SLO or was not sustained (its
# refused_reason says which); "not_reached", every point met the SLO and was sustained, so the knee is at least the
# highest qps measured (and replicas at most what is shown); "below_lowest", even the lowest qps broke it or was not
# sustained (no knee, no replica count: sweep lower rates); "no_points", qps=inf runs only.
KNEE_STATUSES = ("knee", "not_reached", "below_lowest", "no_points")

_KNEE_RUN_COLUMNS = ("qps", KNEE_METRIC, "request_throughput", "output_throughput", "mean_e2el_ms")
# What the knee run's row adds to its curve's, as knee_<name>. A run row from before max_running_requests loads it
# from its old column, and its max_concurrent_requests as null (harness.serve.rows.read_run_table).
_KNEE_RUN_COLUMNS += ("max_concurrent_requests", "max_running_requests")

# The fleet table on disk: one schema whatever a sweep held (a curve without a knee has nulls, still float64).
F64, I64, STR = pa.float64(), pa.int64(), pa.string()
KNEE_FIELDS = arrow_fields(KNEE_ROW_COLUMNS)  # harness.serve.columns: each column's unit and meaning
FLEET_SCHEMA = pa.schema(arrow_fields(FLEET_COLUMNS))
KNEE_COLUMNS = [field.name for field in KNEE_FIELDS]


# --- the runs -------------------------------------------------------------------------------------------------


def _sweep_order(sweep_id: str) -> tuple[str, str]:
    """Newest last: by the timestamp inside the id (an id without one is older than any with one), then its text."""
    stamp = _SWEEP_STAMP.search(sweep_id)
    return (stamp.group(0) if stamp else "", sweep_id)


def load_run_rows(results_dir: str | Path, sweep_id: str | None = None) -> pd.DataFrame:
    """The run rows of one sweep under <results_dir>/serve/*/run.parquet: sweep_id's, or (None) the newest sweep's
    by the timestamp in its id. Unfinished runs (a folder without run.parquet) are skipped. Sorted by curve and qps.

    No finished run, or none of sweep_id, is a one-line ConfigError naming the folder and the sweeps it holds.
    """
    serve_dir = Path(results_dir) / SERVE_DIR
    paths = sorted(
        path for path in serve_dir.glob(f"*/{RUN_FILE}") if not path.parent.name.startswith(".")
    )  # a hidden folder is never a run (rows.serve_run_dir refuses the name)
    if not paths:
        raise ConfigError(
            f"results_dir: no finished serving runs under {serve_dir} (no */{RUN_FILE}); run experiment=serve-qps first"
        )
    frames = []
    for path in paths:
        try:
            frames.append(read_run_table(path).to_pandas(types_mapper={I64: pd.Int64Dtype()}.get))
        except (pa.ArrowInvalid, OSError) as exc:
            raise ValueError(f"{path}: not a run row: {exc}") from None
    rows = pd.concat(frames, ignore_index=True)  # percentile columns a run did not ask for read NaN
    sweeps = sorted(rows["sweep_id"].astype(str).unique(), key=_sweep_order)
    chosen = sweeps[-1] if sweep_id is None else str(sweep_id)
    if chosen not in sweeps:
        raise ConfigError(
            f"sweep_id: no finished runs of {chosen!r} under {serve_dir}; sweeps there: {', '.join(sweeps)}"
        )
    rows = rows[rows["sweep_id"].astype(str) == chosen]
    return rows.sort_values([*CURVE_KEY, "qps"], kind="stable").reset_index(drop=True)


# --- knees and fleets -----------------------------------------------------------------------------------------


def _slo_ms(ttft_slo_ms: float | str) -> float:
    limit_ms = parse_slo_ms(ttft_slo_ms, "ttft_slo_ms")
    if limit_ms is None:
        raise ConfigError(f"ttft_slo_ms: the knee needs a p99 TTFT SLO; {SLO_FORMS}")
    return limit_ms


def knees(frame: pd.DataFrame, ttft_slo_ms: float | str) -> pd.DataFrame:
    """One row per (strategy, kv_dtype, engine) of one sweep's run rows: the curve's points (finite qps), its knee
    (measured; KNEE_STATUSES says what kind) and the knee run's p99 TTFT, throughputs, mean E2E and max concurrency.
    """
    limit_ms = _slo_ms(ttft_slo_ms)
    if frame.empty:
        raise ConfigError("runs: none given; the knees need a sweep's run rows (load_run_rows)")
    for column in ("sweep_id", *CURVE_KEY, *_KNEE_RUN_COLUMNS, "sustained", "not_sustained_reason"):
        if column not in frame.columns:
            raise ConfigError(f"runs: no column {column!r}; the knees need serving run rows (harness.serve.rows)")
    sweeps = sorted(frame["sweep_id"].astype(str).unique(), key=_sweep_order)
    if len(sweeps) > 1:  # two sweeps' points on one curve would mix two setups
        raise ConfigError(f"runs: {len(sweeps)} sweeps ({', '.join(sweeps)}); give one (load_run_rows(sweep_id=...))")
    table = []
    for key, curve in frame.groupby(list(CURVE_KEY), sort=True):
        points = curve[np.isfinite(curve["qps"].astype(float))].sort_values("qps", kind="stable")
        row = dict(zip(CURVE_KEY, key, strict=True)) | {"sweep_id": sweeps[0], "num_points": len(points)}
        row |= {"min_qps": None, "max_qps": None, "ttft_slo_ms": limit_ms, "knee_qps": None, "refused_reason": None}
        row["num_sustained"] = int(sum(verdict is True or verdict is np.True_ for verdict in points["sustained"]))
        row |= {f"knee_{name}": None for name in _KNEE_RUN_COLUMNS[1:]}
        if points.empty:
            table.append(row | {"status": "no_points"})
            continue
        row |= {"min_qps": float(points["qps"].iloc[0]), "max_qps": float(points["qps"].iloc[-1])}
        knee_qps = knee(points, limit_ms, metric=KNEE_METRIC, x="qps")  # sustained points only
        row["refused_reason"] = _refused(points, knee_qps, limit_ms)
        if knee_qps is None:
            table.append(row | {"status": "below_lowest"})
            continue
        at_knee = points[points["qps"] == knee_qps].iloc[-1]
        row |= {"knee_qps": knee_qps} | {f"knee_{name}": at_knee[name] for name in _KNEE_RUN_COLUMNS[1:]}
        table.append(row | {"status": "not_reached" if knee_qps == row["max_qps"] else "knee"})
    result = pd.DataFrame(table)[KNEE_COLUMNS]
    # One dtype per column whatever the curves held (a column of knees all None would be object otherwise).
    return result.astype(
        {field.name: "Int64" if field.type == I64 else float for field in KNEE_FIELDS if field.type != STR}
    )


def _refused(points: pd.DataFrame, knee_qps: float | None, limit_ms: float) -> str | None:
    """Why the first point above the knee (the lowest, with no knee) is refused; None when none is."""
    above = points if knee_qps is None else points[points["qps"] > knee_qps]
    if above.empty:
        return None
    first = above.iloc[0]
    verdict = first["sustained"]
    if not (verdict is True or verdict is np.True_):
        return f"qps {first['qps']:g}: not sustained: {first['not_sustained_reason']}"
    return f"qps {first['qps']:g}: p99 TTFT {_number(first[KNEE_METRIC], '{:.1f}')} ms > {limit_ms:g} ms"


def fleet(frame: pd.DataFrame, target_qps: float, ttft_slo_ms: float | str) -> pd.DataFrame:
    """knees(frame, ttft_slo_ms) plus, per curve, the replicas that serve target_qps (measured: ceil(target / knee))
    and the concurrency Little's law predicts for them (fleet-wide and per replica). A curve without a knee
    (status below_lowest or no_points) has neither: null, not a guess."""
    # The formulas live with the planner, whose module imports torch (harness.config): imported here, so that
    # load_run_rows, knees and summary_lines stay torch-free.
    from harness.serve.budget import concurrency_needed, replicas_needed

    if not (isinstance(target_qps, Real) and not isinstance(target_qps, bool) and 0 < target_qps < math.inf):
        raise ConfigError(f"target_qps: must be a finite number of requests/s > 0, got {target_qps!r}")
    table = knees(frame, ttft_slo_ms).assign(target_qps=float(target_qps))
    replicas, predicted = [], []
    for knee_qps, mean_e2el_ms in table[["knee_qps", "knee_mean_e2el_ms"]].itertuples(index=False):
        if pd.isna(knee_qps):  # no knee: no replica count, and no knee run to take a latency from
            replicas.append(None)
            predicted.append(math.nan)
            continue
        replicas.append(replicas_needed(target_qps, knee_qps))
        predicted.append(concurrency_needed(qps=target_qps, mean_e2e_s=mean_e2el_ms / MS_PER_S))
    table["replicas"] = pd.array(replicas, dtype="Int64")
    table["predicted_concurrency"] = predicted  # requests in flight across the fleet, on average
    table["predicted_concurrency_per_replica"] = table["predicted_concurrency"] / table["replicas"].astype(float)
    return table[FLEET_SCHEMA.names]


def write_fleet(table: pd.DataFrame, directory: str | Path) -> Path:
    """A fleet table to `directory/fleet-<local time>.parquet` through the one atomic writer, cast to FLEET_SCHEMA."""
    arrays = [pa.array(table[field.name], type=field.type, from_pandas=True) for field in FLEET_SCHEMA]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(directory) / f"{FLEET_PREFIX}{stamp}.parquet"
    write_parquet(table=pa.Table.from_arrays(arrays, schema=FLEET_SCHEMA), path=path)
    return path


# --- the printout ---------------------------------------------------------------------------------------------


def _number(value, spec: str = "{:g}") -> str:
    return "-" if value is None or pd.isna(value) else spec.format(value)


def _knee_text(status: str, knee_qps) -> str:
    if status == "knee":
        return _number(knee_qps)
    if status == "not_reached":  # every point met the SLO: the knee is at least the highest qps
        return f">={_number(knee_qps)}"
    return status.replace("_", " ")


def summary_lines(table: pd.DataFrame) -> list[str]:
    """Printable lines for knees() or fleet() output: a header, then a small table whose column groups say which
    figures are measured (from the curve; max running and max in flight are the knee run's peaks) and which
    predicted (Little's law), then a note per marker shown."""
    if table.empty:
        return ["no curves"]
    first = table.iloc[0]
    lines = [f"sweep {first['sweep_id']}: knee = the highest qps whose p99 TTFT <= {first['ttft_slo_ms']:g} ms, "
             "each point up to it sustained (achieved rate within 5% of offered, SLO attainment met)"]  # fmt: skip
    has_fleet = "replicas" in table.columns
    if has_fleet:
        lines.append(
            f"for {first['target_qps']:g} req/s: replicas = ceil(target / knee); in flight = target x mean E2E at the "
            "knee, per replica beside the knee run's max in flight"
        )
    shown = []
    for row in table.itertuples(index=False):
        line = {
            ("", "strategy"): row.strategy,
            ("", "kv_dtype"): row.kv_dtype,
            ("", "engine"): row.engine,
            ("", "points"): row.num_points,
            ("", "sustained"): row.num_sustained,
            ("", "qps"): f"{_number(row.min_qps)}-{_number(row.max_qps)}",
            ("measured", "knee qps"): _knee_text(row.status, row.knee_qps),
            ("measured", "p99 TTFT ms"): _number(row.knee_p99_ttft_ms, "{:.1f}"),
            ("measured", "req/s"): _number(row.knee_request_throughput, "{:.2f}"),
            ("measured", "tok/s"): _number(row.knee_output_throughput, "{:.0f}"),
        }
        if has_fleet:
            line["measured", "replicas"] = _number(row.replicas)
        line["measured", "max running"] = _number(row.knee_max_running_requests)
        line["measured", "max in flight"] = _number(row.knee_max_concurrent_requests)  # null for an old run row
        if has_fleet:
            line["predicted", "per replica"] = _number(row.predicted_concurrency_per_replica, "{:.1f}")
            line["predicted", "in flight"] = _number(row.predicted_concurrency, "{:.1f}")
        shown.append(line)
    frame = pd.DataFrame(shown)
    frame.columns = pd.MultiIndex.from_tuples(frame.columns)  # a group row over the figures: measured, predicted
    lines += [line.rstrip() for line in frame.to_string(index=False).splitlines()]
    notes = {
        "below_lowest": "below lowest: even the lowest qps broke the SLO or was not sustained; sweep lower rates",
        "not_reached": ">=: every qps met the SLO and was sustained; the knee is higher, so fewer replicas may do",
        "no_points": "no points: only qps=inf runs, a burst rather than a rate",
    }
    lines += [note for status, note in notes.items() if (table["status"] == status).any()]
    for row in table.itertuples(index=False):  # what stopped each curve: the SLO, or a rate it did not sustain
        if isinstance(row.refused_reason, str):
            lines.append(f"{row.strategy} / {row.kv_dtype} / {row.engine}: refused {row.refused_reason}")
    return lines
