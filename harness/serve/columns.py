"""The column contracts of a serving run's tables and of a sweep's fleet table: name, Arrow type, unit, meaning.

Column tables as every other table's (harness.store.schema.Column): harness.serve.rows writes the request,
iteration and run tables against them, harness.serve.fleet the knee and fleet table. A `required` column is never
null; the writer refuses a row without it. Torch-free (pyarrow only), as the store's contracts.
"""

from __future__ import annotations

from harness.serve.dataset import DROP_REASONS
from harness.serve.metrics import LATENCY_METRICS
from harness.serve.sustained import SUSTAINED_COLUMNS
from harness.store.schema import Column

_LATENCY_NAMES = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency"}
_LATENCY_NAMES["e2el"] = "end-to-end latency"
DROPPED_MEANINGS = {  # harness.serve.dataset's reasons, among the conversations looked at before num_prompts were kept
    "no_reply": "no human turn with a reply after it (those under two turns counted over the whole file)",
    "prompt_too_short": "a prompt under 4 tokens (vLLM's is_valid_sequence)",
    "output_too_short": "a reply under 4 tokens (vLLM's; not counted with a fixed sharegpt_output_len)",
    "too_long": "prompt + output over max_model_len",
}
assert tuple(DROPPED_MEANINGS) == DROP_REASONS


def _required(name: str, type_: str, unit: str, description: str) -> Column:
    return Column(name, type_, unit, description, required=True)


# One row per finished request: metrics.request_row's keys, plus run_id.
REQUEST_COLUMNS: tuple[Column, ...] = (
    _required("run_id", "string", "", "The serving run (its folder's name)"),
    _required("request_id", "string", "", "The request's id in the run's request stream"),
    _required("arrival_s", "float64", "s", "When the request arrived, on the engine's clock"),
    _required("queue_ms", "float64", "ms", "From arrival to first scheduled"),
    _required("ttft_ms", "float64", "ms", "Time to first token, from arrival"),
    Column("tpot_ms", "float64", "ms", "Mean time per output token after the first; null for a one-token output"),
    _required("itl_ms", "list<float64>", "ms", "The output_len - 1 gaps between tokens; [] for a one-token output"),
    _required("e2el_ms", "float64", "ms", "End-to-end latency, from arrival to the last token"),
    _required("prompt_len", "int64", "tokens", "Prompt tokens of the request"),
    _required("output_len", "int64", "tokens", "Tokens generated for the request"),
    _required(
        "prefix_hit_tokens",
        "int64",
        "tokens",
        "Prompt tokens whose KV came from the prefix cache, device and tiers; prompt_len minus it were computed",
    ),
    Column(
        "prefix_hit_tokens_device",
        "int64",
        "tokens",
        "Of prefix_hit_tokens, those found on the device; null: a row written before it was recorded",
    ),
    Column(
        "prefix_hit_tokens_host",
        "int64",
        "tokens",
        "Of prefix_hit_tokens, those loaded from the host tier (cache.host_gb); null: no tiers",
    ),
    Column(
        "prefix_hit_tokens_disk",
        "int64",
        "tokens",
        "Of prefix_hit_tokens, those loaded from the disk tier (cache.disk_dir); null: no tiers",
    ),
    _required("preemptions", "int64", "", "Times the request was preempted (its KV freed, recomputed later)"),
    # A chat session's (dataset=sharegpt-multiturn)
    Column("session_id", "int64", "", "The chat session the request is a turn of; null: not a session's"),
    Column("turn", "int64", "", "Its turn in the session, from 1; null: not a session's"),
)

_POOL_COUNTS = (  # the scheduler's output after this iteration's allocation
    ("num_running", "", "Requests running this iteration"),
    ("num_waiting", "", "Requests waiting (arrived, not scheduled)"),
    ("num_prefill_tokens", "tokens", "Prompt tokens this iteration's forward prefilled"),
    ("num_decode_tokens", "tokens", "Tokens this iteration's forward decoded"),
    ("num_preempted", "", "Requests preempted this iteration"),
    ("kv_used_blocks", "blocks", "KV pool blocks held by requests"),
    ("kv_free_blocks", "blocks", "KV pool blocks free"),
    ("kv_cached_blocks", "blocks", "KV pool blocks held by the prefix cache alone (reusable, evictable)"),
    ("kv_live_tokens", "tokens", "Tokens whose KV the running requests hold"),
    ("kv_allocated_tokens", "tokens", "Token slots of the blocks allocated (live tokens plus the blocks' unused tail)"),
)
# One row per scheduler iteration: rows.iteration_row's keys, plus run_id.
ITERATION_COLUMNS: tuple[Column, ...] = (
    _required("run_id", "string", "", "The serving run (its folder's name)"),
    _required("iteration", "int64", "", "The iteration's index, from 0"),
    _required("time_s", "float64", "s", "When the iteration was scheduled, on the engine's clock"),
    _required("step_ms", "float64", "ms", "The iteration's forward"),
    _required("scheduler_ms", "float64", "ms", "Host time of the iteration's schedule() and update()"),
    *(_required(name, "int64", unit, description) for name, unit, description in _POOL_COUNTS),
    Column("kv_live_bytes", "float64", "bytes", "kv_live_tokens at the pool's format, scales included; null: unknown"),
    Column(
        "kv_allocated_bytes",
        "float64",
        "bytes",
        "kv_allocated_tokens at the pool's format, scales included; null: unknown",
    ),
)

# Whether the run sustained its offered rate (harness.serve.sustained, issue #30): nullable, since a row written
# before them whose request rows cannot be read has no verdict (rows.read_run_table recomputes it otherwise).
_WINDOW = "the window (arrival ranks k..n-1-k, k = 10% of n: warm-up and drain cut)"
SUSTAINED_RUN_COLUMNS: tuple[Column, ...] = (
    Column("window_start_s", "float64", "s", f"Start of {_WINDOW}: the k-th arrival, engine clock; null: too few"),
    Column("window_end_s", "float64", "s", "End of the window: the (n-1-k)-th arrival, engine clock; null: too few"),
    Column("window_requests", "int64", "", "Requests in the window, n - 2k: those its attainment counts"),
    Column("window_offered_qps", "float64", "req/s", "Arrivals in the window / its length; null: qps=inf (no length)"),
    Column(
        "achieved_qps",
        "float64",
        "req/s",
        "The same count of completions (ranks k..n-1-k by finish) / their span; null: qps=inf",
    ),
    Column("slo_attainment", "float64", "", "Of the window's requests, those meeting every SLO set; null: no SLO"),
    Column("slo_attainment_target", "float64", "", "The attainment a sustained run needs (slo_attainment config)"),
    Column(
        "sustained",
        "bool",
        "",
        "achieved_qps within 5% of window_offered_qps and slo_attainment >= its target: a knee point; null: unknown",
    ),
    Column("not_sustained_reason", "string", "", "Why the run is not sustained; null: sustained"),
)
assert tuple(column.name for column in SUSTAINED_RUN_COLUMNS) == SUSTAINED_COLUMNS

# The run row: metrics.run_metrics' keys, plus run_id and config_json, then what the run was (RUN_CONTEXT), so that
# runs compare without parsing config_json. Its p<P>_<metric>_ms columns follow the percentiles the run asked for,
# so they are added per row (float64, nullable: rows.run_schema) rather than fixed here.
RUN_COLUMNS: tuple[Column, ...] = (
    _required("run_id", "string", "", "The serving run (its folder's name)"),
    _required("config_json", "string", "", "The run's config as JSON"),
    _required("duration_s", "float64", "s", "From the first arrival to the last request finished"),
    _required("completed", "int64", "", "Requests finished"),
    _required("total_input_tokens", "int64", "tokens", "Prompt tokens of the finished requests"),
    _required("total_output_tokens", "int64", "tokens", "Tokens generated for the finished requests"),
    _required("request_throughput", "float64", "req/s", "completed / duration_s"),
    _required("request_goodput", "float64", "req/s", "Requests within every SLO set, per second"),
    *(
        Column(f"{m}_slo_ms", "float64", "ms", f"The run's {m.upper()} SLO; null: none")
        for m in ("ttft", "tpot", "e2el")
    ),
    *SUSTAINED_RUN_COLUMNS,
    _required("output_throughput", "float64", "tok/s", "total_output_tokens / duration_s"),
    _required("total_token_throughput", "float64", "tok/s", "(total_input_tokens + total_output_tokens) / duration_s"),
    *(
        Column(f"{s}_{m}_ms", "float64", "ms", f"{s} {_LATENCY_NAMES[m]} over the run's requests; null: no sample")
        for m in LATENCY_METRICS
        for s in ("mean", "median", "std")
    ),
    _required("max_concurrent_requests", "int64", "", "Most requests in flight at once, queueing included"),
    _required("max_running_requests", "int64", "", "Most requests running at once (first scheduled to finished)"),
    _required("total_preemptions", "int64", "", "Preemptions over the run"),
    _required("prefix_hit_rate", "float64", "", "Prompt tokens served from the prefix cache / all prompt tokens"),
    *(
        Column(
            f"prefix_hit_rate_{source}", "float64", "", f"Prompt tokens served from {where} / all prompt tokens{null}"
        )
        for source, where, null in (
            ("device", "the device's prefix cache", "; null: a row written before it was recorded"),
            ("host", "the host tier", "; null: no tiers"),
            ("disk", "the disk tier", "; null: no tiers"),
        )
    ),
    Column(
        "tier_offloaded_bytes",
        "int64",
        "bytes",
        "Evicted prefix blocks copied from the device into the tiers (every layer's K, V and scales); null: no tiers",
    ),
    Column(
        "tier_loaded_bytes",
        "int64",
        "bytes",
        "Prefix blocks loaded from the tiers into the device: KV not recomputed; null: no tiers",
    ),
    *(
        Column(
            f"tier_{direction}_gbps",
            "float64",
            "GB/s",
            f"{what}, bytes / seconds of the timed copies (GB = 1e9); null: no tiers, or no such copy",
        )  # fmt: skip
        for direction, what in (
            ("d2h", "Offload: device to the host tier"),
            ("h2d", "Load: the host tier to the device"),
            ("disk_write", "Block files written to the disk tier"),
            ("disk_read", "Block files read from the disk tier, checksums checked"),
        )
    ),
    Column("host_gb", "float64", "GB", "The prefix pool's host tier (cache.host_gb, GB = 1e9 bytes); null: none"),
    Column("disk_dir", "string", "", "The prefix pool's disk tier's directory (cache.disk_dir); null: none"),
    Column("disk_gb", "float64", "GB", "The disk tier's capacity (cache.disk_gb); null: no disk tier"),
    Column("policy", "string", "", "strategy=evict: what is kept (cache.policy: h2o, knorm or random); null: others"),
    Column("budget", "int64", "tokens", "strategy=evict: tokens a request holds at most (cache.budget); null: others"),
    Column("obs_window", "int64", "tokens", "strategy=evict: recent tokens always kept (cache.window); null: others"),
    Column(
        "tier_rejected_blocks", "int64", "", "Disk block files refused (checksum or identity): misses; null: no tiers"
    ),
    Column(
        "tier_overlap",
        "bool",
        "",
        "Tier loads overlapped (tier_overlap): disk blocks read ahead, copied in layer by layer during the forward; "
        "false: synchronous; null: no tiers",
    ),
    Column(
        "tier_load_s",
        "float64",
        "s",
        "The tier loads' own time: disk reads with checksums, copies into the pool (CUDA: host time only); null: "
        "no tiers",
    ),
    Column(
        "tier_load_hidden_s",
        "float64",
        "s",
        "Of tier_load_s, the loader thread's time nothing waited for (reads ahead no lookup used count too); 0 "
        "without overlap; null: no tiers",
    ),
    Column("tier_load_hidden_share", "float64", "", "tier_load_hidden_s / tier_load_s; null: no tiers, or no load"),
    _required("sweep_id", "string", "", "The sweep the run belongs to (the runs of one -m sweep); a single run's own"),
    _required("engine", "string", "", "kvbench, or the peer (transformers)"),
    _required("strategy", "string", "", "KV-cache strategy name"),
    _required("kv_dtype", "string", "", "Storage dtype of the KV pool"),
    _required("model", "string", "", "Model preset name"),
    _required("device", "string", "", "cpu or cuda"),
    _required("qps", "float64", "req/s", "Arrival rate; inf: every request at t = 0"),
    _required("num_blocks", "int64", "blocks", "Blocks of the KV pool"),
    _required("block_size", "int64", "tokens", "Tokens per block"),
    _required("kv_budget_bytes", "int64", "bytes", "The KV budget the pool was sized from"),
    Column(
        "max_num_seqs",
        "int64",
        "",
        "Scheduler cap on running requests; null: a row written before it was recorded (config_json holds it)",
    ),
    Column(
        "max_num_batched_tokens",
        "int64",
        "tokens",
        "Scheduler cap on tokens per iteration; null: a row written before it was recorded (config_json holds it)",
    ),
    Column("num_iterations", "int64", "", "Scheduler iterations; null: an engine that does not say (the peer)"),
    Column(
        "predicted_max_running",
        "int64",
        "",
        "The planner's concurrency for the pool (harness.serve.concurrency.predict_concurrency); null: none",
    ),
    Column("mean_kv_utilization", "float64", "", "Used / all blocks, mean over iterations"),
    Column("peak_kv_utilization", "float64", "", "Used / all blocks, at the fullest iteration"),
    Column("mean_step_ms", "float64", "ms", "Per iteration: the forward, host clock"),
    Column("mean_scheduler_ms", "float64", "ms", "Per iteration: schedule() and update(), host clock"),
    Column(
        "dataset",
        "string",
        "",
        "Where the requests came from: random (the synthetic stream), trace, sharegpt or sharegpt-multiturn; null: a row written before "
        "it was recorded (random)",
    ),
    Column("dataset_sha256", "string", "", "sha256 of the dataset file read (sharegpt); null: random or trace"),
    *(
        Column(f"dataset_dropped_{reason}", "int64", "", f"Conversations dropped: {meaning}; null: random or trace")
        for reason, meaning in DROPPED_MEANINGS.items()
    ),
    *(
        Column(
            f"dataset_cut_turns_{reason}",
            "int64",
            "",
            f"Turns cut off kept sessions at a turn with {meaning}, and the turns after it; null: not sessions",
        )
        for reason, meaning in DROPPED_MEANINGS.items()
        if reason != "no_reply"
    ),  # fmt: skip
    # A lossy strategy's accuracy (harness.serve.accuracy): its first accuracy_requests requests, teacher-forced on
    # the exact pass's greedy outputs; null: an exact strategy, or accuracy_requests=0
    *(
        Column(
            f"accuracy_kl_{stat}",
            "float64",
            "nats",
            f"{what} KL(exact || lossy) of the next-token distributions "
            "over the measured output positions; null: not measured",
        )
        for stat, what in (("mean", "Mean"), ("p99", "99th percentile"), ("max", "Largest"))
    ),
    Column(
        "accuracy_top1_agreement",
        "float64",
        "",
        "Fraction of measured output positions whose argmax equals exact serving's; null: not measured",
    ),
    Column("accuracy_tokens", "int64", "tokens", "Output positions measured (every output of the requests measured)"),
    Column("accuracy_requests", "int64", "", "Requests measured: the stream's first accuracy_requests; null: none"),
    Column(
        "accuracy_reference",
        "string",
        "",
        'The exact serving compared against, "<strategy> <kv_dtype>" (paged at the run\'s kv_dtype); null: none',
    ),
    Column(
        "ttft_ms_by_turn",
        "string",
        "ms",
        'Sessions: TTFT by turn as JSON, {"<turn from 1>": {"count", "p50", "p99"}}; null: not sessions',
    ),
)

# A sweep's knee per curve (harness.serve.fleet.knees); every column nullable: a curve without a knee has nulls.
KNEE_ROW_COLUMNS: tuple[Column, ...] = (
    Column("sweep_id", "string", "", "The sweep"),
    Column("strategy", "string", "", "KV-cache strategy name (the curve's)"),
    Column("kv_dtype", "string", "", "Storage dtype of the KV pool (the curve's)"),
    Column("engine", "string", "", "kvbench or the peer (the curve's)"),
    Column("status", "string", "", "knee, not_reached, below_lowest or no_points (harness.serve.fleet.KNEE_STATUSES)"),
    Column("num_points", "int64", "", "Runs at a finite qps"),
    Column("num_sustained", "int64", "", "Of them, those that sustained their rate (the run rows' sustained)"),
    Column("min_qps", "float64", "req/s", "Lowest arrival rate of the curve"),
    Column("max_qps", "float64", "req/s", "Highest arrival rate of the curve"),
    Column("ttft_slo_ms", "float64", "ms", "The TTFT SLO the knee is found under"),
    Column(
        "knee_qps",
        "float64",
        "req/s",
        "Measured: the highest qps whose p99 TTFT stays within the SLO, every point up to it sustained",
    ),
    Column(
        "refused_reason",
        "string",
        "",
        "Why the first qps above the knee (the lowest, with none) is refused: over the SLO, or not sustained and why",
    ),
    Column("knee_p99_ttft_ms", "float64", "ms", "The knee run's p99 TTFT"),
    Column("knee_request_throughput", "float64", "req/s", "The knee run's request_throughput"),
    Column("knee_output_throughput", "float64", "tok/s", "The knee run's output_throughput"),
    Column("knee_mean_e2el_ms", "float64", "ms", "The knee run's mean end-to-end latency"),
    Column("knee_max_concurrent_requests", "int64", "", "The knee run's most requests in flight, queueing included"),
    Column("knee_max_running_requests", "int64", "", "The knee run's most requests running at once"),
)
# The fleet table: the knees, and the fleet that serves target_qps from each (harness.serve.fleet.fleet).
FLEET_COLUMNS: tuple[Column, ...] = KNEE_ROW_COLUMNS + (
    Column("target_qps", "float64", "req/s", "The rate the fleet serves"),
    Column("replicas", "int64", "", "Measured: ceil(target_qps / knee_qps)"),
    Column("predicted_concurrency", "float64", "", "Little's law: target_qps x the knee run's mean E2E latency"),
    Column("predicted_concurrency_per_replica", "float64", "", "predicted_concurrency / replicas"),
)
