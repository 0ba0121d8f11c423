"""Synthetic result rows for the chart tests (tests/test_charts_*.py), and how they read a plotly figure."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from harness.store.schema import PROFILE_CATEGORIES

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
GIB = 2**30


def point(**overrides) -> dict:
    """One ok decode row with every column some chart reads: small bf16 on an H200, batch 1, prompt 512."""
    batch = overrides.get("batch_size", 1)
    row = dict(
        status="ok",
        model="small",
        device="cuda",
        device_name="NVIDIA H200",
        dtype="bf16",
        kv_dtype="bf16",
        cache="contiguous",
        batch_size=batch,
        prompt_len=512,
        gen_len=32,
        tpot_ms=10.0,
        tpot_p90_ms=11.0,
        tpot_p99_ms=12.0,
        ttft_ms=50.0,
        decode_tok_s=batch * 100.0,
        itl_ms=[10.0, 10.5, 11.0],
        weights_bytes=2 * GIB,
        kv_bytes_allocated=GIB // 2,
        kv_bytes_predicted=GIB // 2,
        peak_mem_bytes=4 * GIB,
        mem_baseline_bytes=GIB // 4,
        kv_waste_fraction=0.1,
        top1_agreement=1.0,
        kl_mean=0.0,
        flops_per_step=2e9 * batch,
        arithmetic_intensity=1.0 * batch,
        achieved_tflops=0.1 * batch,
        predicted_tpot_ms=8.0,
        peak_bw_gbps=4000.0,
        peak_tflops=800.0,
        critical_batch=8.0,
        critical_context=5000.0,
        bound="memory",
        **{f"prof_{category}_frac": 1 / 6 for category in PROFILE_CATEGORIES},
    )
    return row | overrides


def frame(*points: dict) -> pd.DataFrame:
    return pd.DataFrame(list(points))


def sweep(tpots: dict[int, float], **overrides) -> pd.DataFrame:
    """A batch sweep: one point per batch with the given TPOT (ms)."""
    return frame(*(point(batch_size=b, tpot_ms=t, decode_tok_s=b * 1000 / t, **overrides) for b, t in tpots.items()))


def trace_names(fig: go.Figure) -> list[str]:
    return [trace.name for trace in fig.data]


def trace(fig: go.Figure, name: str):
    (found,) = [t for t in fig.data if t.name == name]
    return found


def annotation_texts(fig: go.Figure) -> list[str]:
    return [annotation.text for annotation in fig.layout.annotations]
