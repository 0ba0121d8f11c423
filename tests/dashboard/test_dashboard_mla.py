"""The memory page knows MLA: the planner's figure a run records for an MLA point (kv_bytes_planner,
harness.run.point.planner_kv_bytes) is its latent cache, layers × (kv_lora_rank + qk_rope_head_dim) × bytes a
token, and the ledger chart draws it beside a GQA model's four times larger KV."""

from __future__ import annotations

from dashboard.charts.memory import PLANNER_COLUMN, memory_ledger
from harness.config import RunConfig
from harness.run.point import config_columns
from tests.dashboard.charts_rows import GIB, frame, point, trace

TOKENS = 4096 - 32  # prompt_len; + gen_len 32
V2_LITE_PER_TOKEN = 27 * (512 + 64) * 2  # bytes, bf16
LLAMA_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def planner_figure(model: str) -> int | None:
    """The kv_bytes_planner a bf16 contiguous run of `model` at batch 4, prompt TOKENS, gen 32 records."""
    cfg = RunConfig(
        model={"name": model}, dtype="bf16", cache="contiguous", batch_size=4, prompt_len=TOKENS, gen_len=32
    )
    return config_columns(cfg)["kv_bytes_planner"]


def rows():
    # As harness/run/point.py records a row: the model's n_kv_heads and head_dim (MLA: n_heads, nope + rope).
    return frame(
        point(model="deepseek-v2-lite", n_layers=27, n_kv_heads=16, head_dim=192, batch_size=4, prompt_len=TOKENS),
        point(model="llama-3.1-8b", n_layers=32, n_kv_heads=8, head_dim=128, batch_size=4, prompt_len=TOKENS),
    )


def test_the_planner_figure_of_an_mla_point_is_its_latent_cache():
    planned = [planner_figure("deepseek-v2-lite"), planner_figure("llama-3.1-8b")]
    assert planned == [4 * 4096 * V2_LITE_PER_TOKEN, 4 * 4096 * LLAMA_PER_TOKEN]


def test_the_ledger_draws_mla_beside_gqa_with_each_planner_figure():
    table = rows()
    table = table.assign(**{PLANNER_COLUMN: [planner_figure(model) for model in table["model"]]})
    planner = trace(memory_ledger(table), "planner (weights + KV)")
    weights = 2  # GiB, the rows' weights_bytes
    assert sorted(planner.y) == sorted(
        [weights + 4 * 4096 * V2_LITE_PER_TOKEN / GIB, weights + 4 * 4096 * LLAMA_PER_TOKEN / GIB]
    )
