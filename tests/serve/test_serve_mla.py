"""MLA models served (issue #30 item 1a): the latent pool ([c_kv | k_rope] per token, no V) read per sequence by
harness.modeling.mla.MLAttention._attend_varlen against solo decoding, as tests/serve/test_serve_engine.py holds
GQA serving: in fp32 every request's greedy tokens equal its prompt decoded alone through a batch-1 static cache
(tests/greedy.py's rule), whatever shares its iterations: chunked prefills beside decodes, preemption by recompute
and by swap, prefix hits. Also: the absorbed and naive decode paths agree; per-token formats match the static
paged path at that format; the planner's concurrency for latent blocks is within 10% of a served run's; what MLA
serving cannot run is one line."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile

import pytest
import torch

from harness import kv
from harness.errors import ConfigError
from harness.kv.base import CacheSpec
from harness.kv.varlen import SeqBatch
from harness.modeling.model import build_model
from harness.modeling.model_args import ModelArgs
from harness.serve import run as app
from harness.serve.budget import bytes_per_block
from harness.serve.engine import Engine, build_cache, check_servable, serve
from harness.serve.kv_manager import make_kv_manager
from harness.serve.requests import Request, RequestSpec, generate, prompt_token_ids
from harness.serve.rows import load_run, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits
from tests.serve.test_serve_experiment import BUDGET, ROOT, TINY, config

CPU = torch.device("cpu")
ARGS = ModelArgs.from_name("mla-tiny")  # 2 layers, 4 heads; latent R = 32, P = 16: 48 values per token and layer
MAX_MODEL_LEN = 96
BLOCK = 4
MLA_TINY = [o if not o.startswith("model=") else "model=mla-tiny" for o in TINY]


@functools.cache
def model(path: str = "absorbed"):
    return build_model(ARGS, dtype=torch.float32, device=CPU, seed=0, n_positions=MAX_MODEL_LEN, mla_path=path)


def mixed_requests(n: int = 10, *, prefix_len: int = 0, seed: int = 1) -> tuple[list[Request], list[list[int]]]:
    spec = RequestSpec(num_prompts=n, qps=float("inf"), seed=seed, prompt_len=24, prompt_dist="uniform",
                       prompt_spread=0.6, output_len=12, output_dist="uniform", output_spread=0.5,
                       prefix_len=prefix_len, max_model_len=MAX_MODEL_LEN)  # fmt: skip
    requests = generate(spec)
    return requests, prompt_token_ids(requests, vocab_size=ARGS.vocab_size, seed=seed)


@functools.cache
def solo_reference(prompt: tuple[int, ...], output_len: int, kv_dtype: str = "fp32"):
    """(tokens [output_len], logits [output_len, V]) of the prompt decoded alone by the static path: a batch-1
    contiguous cache in fp32, or a paged one at a narrow format (the static paged path's latent codec)."""
    spec = CacheSpec.for_model(ARGS, batch_size=1, max_tokens=len(prompt) + output_len, kv_dtype=kv_dtype, device=CPU)
    cache = kv.build("contiguous", spec, {}) if kv_dtype == "fp32" else kv.build("paged", spec, {"block_size": BLOCK})
    tokens, logits = greedy_with_logits(model(), cache, torch.tensor([prompt]), output_len)
    return tokens[0], logits[0]


def run_engine(requests, prompts, *, strategy="paged", num_blocks=256, kv_dtype="fp32", path="absorbed", **knobs):
    manager = make_kv_manager(strategy, num_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN, **knobs), manager)
    cache, num_slots = build_cache(strategy, ARGS, kv_dtype=kv_dtype, num_blocks=num_blocks, block_size=BLOCK,
                                   max_model_len=MAX_MODEL_LEN, device=CPU)  # fmt: skip
    if num_slots is None:
        assert cache.v_pool is None  # a pool of latent blocks: no V
    iterations = []
    result = serve(requests, prompts, scheduler=scheduler, engine=Engine(model(path), cache, num_slots=num_slots),
                   on_iteration=lambda i, output, *_: iterations.append(output))  # fmt: skip
    assert sorted(result.outputs) == [r.request_id for r in requests]
    return result, iterations


def assert_solo_equal(requests, prompts, result, *, kv_dtype="fp32"):
    for request, prompt in zip(requests, prompts, strict=True):
        expected, logits = solo_reference(tuple(prompt), request.output_len, kv_dtype)
        actual = torch.tensor(result.outputs[request.request_id])
        assert len(actual) == request.output_len
        assert_same_greedy_tokens(actual[None], expected[None], logits[None], tol=LOGIT_TOL[kv_dtype])


@pytest.mark.parametrize("path", ["absorbed", "naive"])
@pytest.mark.parametrize("strategy", ["contiguous", "paged"])
def test_mla_mixed_lengths_with_chunked_prefill_match_solo_decoding(strategy, path):
    requests, prompts = mixed_requests()
    # 16 tokens per iteration: prompts of 10..38 tokens are chunked, and decodes share iterations with chunks.
    result, iterations = run_engine(requests, prompts, strategy=strategy, path=path, max_num_batched_tokens=16)
    assert any(o.num_prefill_tokens and o.num_decode_tokens for o in iterations), "no mixed iteration"
    assert any(s.is_prefill and not s.samples_token for o in iterations for s in o.scheduled), "no chunked prompt"
    assert max(o.num_running for o in iterations) > 3
    assert_solo_equal(requests, prompts, result)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mla_preemption_in_a_tiny_pool_matches_solo_decoding(mode):
    requests, prompts = mixed_requests()
    # 14 blocks of 4 tokens: two to three requests at their peak, so growing decodes preempt.
    result, iterations = run_engine(requests, prompts, num_blocks=14, preemption_mode=mode, watermark=0.0,
                                    max_num_batched_tokens=16)  # fmt: skip
    assert sum(record.preemptions for record in result.records) > 0
    if mode == "swap":
        assert any(output.swapped_in_ids for output in iterations)
    assert_solo_equal(requests, prompts, result)


def test_mla_prefix_hits_on_the_latent_pool_match_solo_decoding():
    """The engine shares latent blocks as it shares K/V blocks (the scheduler's block hashes; the latent is a
    function of the tokens and positions alone). A ServeConfig still refuses strategy=prefix for MLA, by
    PrefixLayout.stores_latent (the static prefix cache was not scoped for MLA): this holds the engine's half."""
    requests, prompts = mixed_requests(prefix_len=8)
    result, _ = run_engine(requests, prompts, strategy="prefix", max_num_batched_tokens=32)
    hits = [record.prefix_hit_tokens for record in result.records]
    assert sum(1 for h in hits if h) >= len(requests) - 2 and max(hits) == 8  # the 8-token prefix: two whole blocks
    assert_solo_equal(requests, prompts, result)


def test_the_absorbed_and_naive_paths_give_one_served_forwards_logits():
    """One flattened forward of two decodes and two prefill chunks (one mid-prompt) through each path, over the
    same latent pool: equal in exact arithmetic (DeepSeek-V2 section 2.1.2), so within fp32's rounding here."""
    batch = SeqBatch(slots=(0,) * 4, start_pos=(5, 9, 0, 4), n_new=(1, 1, 6, 3),
                     block_tables=((0, 1), (2, 3, 4), (5, 6), (7, 8)))  # fmt: skip
    history = torch.randint(0, ARGS.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for path in ("absorbed", "naive"):
        cache, _ = build_cache("paged", ARGS, kv_dtype="fp32", num_blocks=9, block_size=BLOCK,
                               max_model_len=MAX_MODEL_LEN, device=CPU)  # fmt: skip
        fill = SeqBatch(slots=(0,) * 3, start_pos=(0, 0, 0), n_new=(5, 9, 4),
                        block_tables=batch.block_tables[:2] + batch.block_tables[3:])  # fmt: skip
        tokens = torch.cat([history[:, :5], history[:, :9], history[:, 2:6]], dim=1)
        with torch.inference_mode():
            model(path)(tokens, fill, cache)  # the decodes' and the mid-prompt chunk's history, by prefill
            logits[path] = model(path)(history[:, : batch.n_tokens], batch, cache)  # [1, N, V]
    assert logits["absorbed"].shape == (1, batch.n_tokens, ARGS.vocab_size)
    torch.testing.assert_close(logits["absorbed"], logits["naive"], atol=1e-5, rtol=1e-5)
    assert not torch.equal(logits["absorbed"][0, 0], logits["absorbed"][0, 1])  # the rows are not one row copied


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8"])
def test_mla_served_at_a_per_token_format_matches_the_static_paged_path(kv_dtype):
    """The latent through the format codec (its scales per token in pools of their own) as the static paged path
    stores it: the same codes, so the same tokens but for near-ties at the format's tolerance."""
    requests, prompts = mixed_requests(6)
    result, _ = run_engine(requests, prompts, kv_dtype=kv_dtype, max_num_batched_tokens=16)
    assert_solo_equal(requests, prompts, result, kv_dtype=kv_dtype)


def test_mla_with_eager_attention_or_a_window_is_one_line():
    with pytest.raises(ConfigError, match=r"^attn_impl: mla-tiny is MLA, .*; allowed: sdpa$"):
        check_servable(ARGS, attn_impl="eager")
    with pytest.raises(ConfigError, match=r"^strategy: mla-tiny is MLA, .* no sliding window; allowed: "):
        check_servable(ARGS, windowed=True)
    check_servable(ARGS)  # sdpa, no window: served
    check_servable(ModelArgs.from_name("tiny"), attn_impl="eager", windowed=True)  # GQA: not this check's


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=sliding", "sliding_window=8"], "^strategy: mla-tiny is MLA"),
        (["strategy=prefix"], "^cache.name: prefix does not store mla-tiny's MLA latent; allowed: contiguous, paged$"),
        (["kv_dtype=int4"], "^kv_dtype: "),
    ],
)
def test_what_mla_serving_cannot_run_is_one_config_error_at_plan(overrides, message):
    with pytest.raises(ConfigError, match=message):
        app.plan(config(*MLA_TINY, "kv_memory_gb=0.01", "prompt_len=40", "output_len=8", *overrides))


@functools.cache
def concurrency(model_name: str, strategy: str, kv_dtype: str) -> tuple[int, int, int]:
    """(measured max running, planner's predicted_max_running, bytes per block) of a served run at
    tests/serve/test_serve_experiment.py's budget and request set."""
    overrides = [o if not o.startswith("model=") else f"model={model_name}" for o in TINY]
    p = app.plan(config(*overrides, *BUDGET, f"strategy={strategy}", f"kv_dtype={kv_dtype}"))
    with tempfile.TemporaryDirectory() as directory:
        row = app.run(p, run_dir=serve_run_dir(directory, "r"), sweep_id="s")
    return row["max_running_requests"], row["predicted_max_running"], p.budget_bytes_per_block


@pytest.mark.parametrize(("strategy", "kv_dtype"), [("contiguous", "bf16"), ("paged", "bf16"), ("paged", "fp8_e4m3")])
def test_the_measured_mla_concurrency_is_within_ten_percent_of_the_planners(strategy, kv_dtype):
    measured, predicted, _ = concurrency("mla-tiny", strategy, kv_dtype)
    assert measured == pytest.approx(predicted, rel=0.10), (measured, predicted)


def test_a_latent_block_is_priced_as_one_row_of_r_plus_p_values_and_fits_more_requests_than_gqa():
    """A block of 16 tokens holds, per layer, one latent row of R + P = 48 values per token, no V: 3072 bytes in bf16
    over mla-tiny's 2 layers, against tiny's GQA 2 sides x 2 heads x 16 values = 4096; fp8 adds an fp32 scale per
    token and layer. At one budget, the served runs admit in that ratio."""
    workload = config(*MLA_TINY, "kv_memory_gb=0.01").workload(kv_dtype="bf16")
    assert bytes_per_block(workload) == ARGS.n_layers * 16 * (32 + 16) * 2 == 3072
    fp8 = config(*MLA_TINY, "kv_memory_gb=0.01").workload(kv_dtype="fp8_e4m3")
    assert bytes_per_block(fp8) == ARGS.n_layers * 16 * ((32 + 16) * 1 + 4) == 1664
    mla, gqa = concurrency("mla-tiny", "paged", "bf16")[0], concurrency("tiny", "paged", "bf16")[0]
    assert mla > 1.15 * gqa  # 4096 / 3072 = 1.33x the blocks at one budget


@pytest.mark.slow
def test_an_mla_run_of_experiments_serve_writes_its_requests_iterations_and_run_row(tmp_path):
    stream = ["kv_memory_gb=0.002", "num_prompts=8", "qps=inf", "prompt_len=40", "output_len=8", "run_id=mla",
              "max_num_seqs=8", "max_num_batched_tokens=32"]  # fmt: skip
    command = [sys.executable, "-m", "experiments.serve", f"results_dir={tmp_path}", *MLA_TINY, *stream]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planner predicted" in result.stdout
    requests, iterations, run = load_run(serve_run_dir(tmp_path, "mla"))
    assert len(requests) == 8 and (requests["output_len"] == 8).all()
    assert iterations["num_decode_tokens"].sum() + iterations["num_prefill_tokens"].sum() >= 8 * (40 + 7)
    assert run["completed"] == 8 and run["model"] == "mla-tiny" and run["strategy"] == "paged"
    assert run["predicted_max_running"] >= 1
    assert json.loads(run["config_json"])["model"]["name"] == "mla-tiny"
