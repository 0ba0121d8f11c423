"""The column contracts: every column's name, Arrow type, unit and meaning, in one place.

COLUMNS is a result row's (one measured point); FRONTIER_COLUMNS a capacity OOM-frontier table's (one row per
context, experiments/capacity.py). Torch-free (pyarrow only), so that the store, the README generator and the
dashboard read the same contract without importing the measuring code. The Parquet schemas, the README table
(`kvbench-results columns`) and the loader's column order all come from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# The profiler's categories of step time (harness.measure.profile classifies each op into one); each has a
# prof_<category>_frac column below, and the dashboard colours them in this order.
PROFILE_CATEGORIES = ("attention", "gemm", "norm_elementwise", "kv", "sampling", "other")

# Bump when a column changes meaning or type. Adding a column needs no bump: older files load with it null.
# 2: energy_j_per_token and mean_power_w cover the measured generations only (1: warm-up included); clocks and
# throttle reasons sampled inside that window (sm_clock_mhz_min/max, ...) replace the *_start/*_end reads.
# 3: peak_bw_gbps is the roof the roofline used (bw_roof: the streaming-read bandwidth for decode), no longer always
# the copy bandwidth; bw_util and predicted_tpot_ms follow it.
SCHEMA_VERSION = 3

# What a row ran, apart from how its KV was kept: rows equal on these compare strategies and formats like with like
# (the dashboard's views, `kvbench-results compare`). A view never takes a median across different workloads.
WORKLOAD_COLUMNS = (
    "model",
    "weights",
    "device",
    "dtype",
    "batch_size",
    "prompt_len",
    "gen_len",
    "prefix_len",
    "prompt_source",
    "lengths",
    "compile",
    "attn_impl",
    "mla_path",
    "runner",
    "loop",
    "lever",
)
# How a row kept its KV: the strategy, the storage format and their options (null where a strategy has none).
# The strategies' option columns (harness.kv.base.Layout.option_columns), null for a strategy without the option.
OPTION_COLUMNS = (
    "block_size",
    "pool_tokens",
    "window",
    "sinks",
    "policy",
    "budget",
    "obs_window",
    "host_gb",
    "disk_dir",
    "disk_gb",
)
KV_COLUMNS = ("cache", "kv_dtype", *OPTION_COLUMNS, "kv_group_size", "kv_residual")
# Two rows measure the same thing when every one of these is equal: what `kvbench-results compare` pairs by.
POINT_KEY_COLUMNS = WORKLOAD_COLUMNS + KV_COLUMNS

_ARROW_TYPES = {
    "string": pa.string(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "list<float64>": pa.list_(pa.float64()),
}


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # one of _ARROW_TYPES
    unit: str  # "" when the value has none (names, counts, ratios)
    description: str
    # The value of a row recorded before the column existed, when it is known (attn_impl: every such row ran
    # SDPA); None: unknown, a null.
    absent: str | None = None
    # Never null: a writer refuses a row without it (the serving tables' measured figures); a result row's columns
    # are all nullable (a failed point has no figures).
    required: bool = False

    def __post_init__(self) -> None:
        if self.type not in _ARROW_TYPES:
            raise ValueError(f"column {self.name!r}: type {self.type!r} is not one of {sorted(_ARROW_TYPES)}")


COLUMNS: tuple[Column, ...] = (
    # Identity
    Column("point_id", "string", "", "Stable hash of the measurement config; also the row's file name"),
    Column("sweep_id", "string", "", "Identifier of the sweep (one invocation) that produced the row"),
    Column(
        "status",
        "string",
        "",
        "Outcome of the point: ok, oom, error, unsupported, or skipped_oom (not run: the OOM backstop, see error)",
    ),
    Column("error", "string", "", "Error message when status is not ok; null when ok"),
    # Config
    Column("model", "string", "", "Model preset name"),
    Column("n_params", "int64", "", "Number of model parameters"),
    Column("n_layers", "int64", "", "Transformer layers"),
    Column("n_heads", "int64", "", "Query heads per layer"),
    Column("n_kv_heads", "int64", "", "Key/value heads per layer (fewer than n_heads under GQA/MQA)"),
    Column("head_dim", "int64", "", "Channels per attention head"),
    Column(
        "dtype",
        "string",
        "",
        "Compute dtype of weights and activations: fp32, fp16 or bf16; a llama.cpp row's GGUF tensor type (f32, f16, "
        "q4_1)",
    ),
    Column(
        "kv_dtype",
        "string",
        "",
        "Storage dtype of the KV cache (kv_dtype=auto resolved to dtype); a llama.cpp row's type_k = type_v (f32, "
        "f16, q8_0, q4_0)",
    ),
    Column("cache", "string", "", "KV-cache strategy name"),
    Column("block_size", "int64", "tokens", "Tokens per KV block; null unless the cache is paged"),
    Column("pool_tokens", "int64", "tokens", "Token capacity of the KV block pool; null unless the cache is paged"),
    Column("kv_group_size", "int64", "", "int4: values per quantization group; null for other kv_dtypes"),
    Column("kv_residual", "int64", "tokens", "int4: most recent tokens kept in full precision (KIVI); null otherwise"),
    Column("window", "int64", "tokens", "Sliding window: cached tokens per sequence at most; null unless sliding"),
    Column("sinks", "int64", "tokens", "Sliding window: first tokens always kept (StreamingLLM); null unless sliding"),
    Column("policy", "string", "", "Token eviction: what is kept (h2o, snapkv, knorm, random); null unless evict"),
    Column(
        "budget", "int64", "tokens", "Token eviction: tokens kept per sequence, layer and KV head; null unless evict"
    ),
    Column(
        "obs_window",
        "int64",
        "tokens",
        "Token eviction: most recent tokens always kept (SnapKV's observation window); null unless evict",
    ),
    Column(
        "host_gb", "float64", "GB", "Prefix tiers: host tier capacity, GB = 1e9; null: no host tier (or not prefix)"
    ),
    Column(
        "disk_dir",
        "string",
        "",
        "Prefix tiers: the disk tier's directory, which outlives the run; null: no disk tier (or not prefix)",
    ),
    Column(
        "disk_gb", "float64", "GB", "Prefix tiers: disk tier capacity, GB = 1e9; null: no disk tier (or not prefix)"
    ),
    Column("batch_size", "int64", "", "Sequences decoded together"),
    Column("prompt_len", "int64", "tokens", "Prompt tokens per sequence"),
    Column("gen_len", "int64", "tokens", "Tokens generated per sequence, the first one included"),
    Column("prefix_len", "int64", "tokens", "Leading prompt tokens shared by every sequence of the batch (0: none)"),
    Column(
        "prompt_source",
        "string",
        "",
        "Where the prompt ids came from: random (seeded ids), sharegpt (ShareGPT conversations through the model's "
        "tokenizer and chat template) or text (windows of prompt_text)",
        absent="random",
    ),
    Column("prompt_text", "string", "", "prompt_source=text: the local text file; null otherwise"),
    Column("prompt_sha256", "string", "", "sha256 hex of the file the prompts came from; null for random ids"),
    Column("lengths", "string", "", "fixed (every sequence prompt_len + gen_len) or mixed (allocation-waste points)"),
    Column(
        "min_len_frac", "float64", "", "mixed: request lengths drawn uniformly from [min_len_frac, 1] of the maximum"
    ),
    Column("mean_request_len", "float64", "tokens", "mixed: mean final length (prompt + generated) of the requests"),
    Column("device", "string", "", "cpu or cuda"),
    Column("weights", "string", "", "dummy (random weights) or the checkpoint path"),
    Column(
        "runner",
        "string",
        "",
        "Whose decode loop: kvbench, transformers (make bench's side-by-side) or llama.cpp (make bench-llamacpp)",
    ),
    Column(
        "loop",
        "string",
        "",
        "make bench's loop: kvbench (with its probes), kvbench-bare (without them), hf-dynamic or hf-static "
        "(transformers' generate() with its DynamicCache or StaticCache), llama.cpp (make bench-llamacpp: llama_decode "
        "per token through llama-cpp-python); null for a decode point",
    ),
    Column(
        "lever",
        "string",
        "",
        "make bench's lever variant of the bare loop (harness.run.levers): baseline (fused, eager, torch's threads), "
        "unfused, compiled (compile=default, on the CPU frozen and weight-prepacked) or pinned-threads; null elsewhere",
    ),
    Column("compile", "string", "", "torch.compile mode of the decode step: none, default or reduce-overhead"),
    Column(
        "compile_s",
        "float64",
        "s",
        "make bench's compiled lever: the compiling generation's wall time over an eager one's (in no TPOT); null "
        "elsewhere",
    ),
    Column(
        "attn_impl",
        "string",
        "",
        "How attention ran: sdpa (fused kernels, no score matrix) or eager (scores [B, H, T, S] written out, softmax, "
        "a second matmul)",
        absent="sdpa",
    ),
    Column(
        "mla_path",
        "string",
        "",
        "MLA models: absorbed (attention over the cached latent, W_UK/W_UV folded in) or naive (K and V decompressed "
        "from it each step); null for other models",
    ),
    Column("kv_lora_rank", "int64", "", "MLA: width of the cached latent c_kv per token and layer; null otherwise"),
    Column(
        "moe_as_dense",
        "bool",
        "",
        "The model's MoE feed-forward stood in for by a dense one of the same active width (DeepSeek presets)",
    ),
    Column(
        "attn_backend",
        "string",
        "",
        "Attention implementation of the decode step: sdpa, triton-paged, flashinfer, eager, eager-gather, ...",
    ),
    Column(
        "cudagraph_skips",
        "int64",
        "",
        "compile=reduce-overhead: times inductor skipped CUDA graphs for the step (0: captured; more makes the row an "
        "error); null otherwise",
    ),
    Column("seed", "int64", "", "Random seed of the weights and prompt tokens"),
    Column(
        "max_memory_gb",
        "float64",
        "GiB",
        "Cap on the measuring process (RLIMIT_DATA on CPU; on CUDA the allocator's fraction, less what the process "
        "already holds, CUDA context included); null when unset",
    ),
    # Latency
    Column("ttft_ms", "float64", "ms", "Time to first token (prefill plus the first token), median over repeats"),
    Column("ttft_p90_ms", "float64", "ms", "90th percentile of TTFT over repeats"),
    Column("ttft_p99_ms", "float64", "ms", "99th percentile of TTFT over repeats"),
    Column(
        "tpot_ms",
        "float64",
        "ms",
        "Time per output token after the first: median over repeats of each repeat's mean decode-step time",
    ),
    Column("tpot_p90_ms", "float64", "ms", "90th percentile over repeats of the per-repeat TPOT"),
    Column("tpot_p99_ms", "float64", "ms", "99th percentile over repeats of the per-repeat TPOT"),
    Column("tpot_cv", "float64", "", "Coefficient of variation (std / mean) of the per-repeat TPOT"),
    Column("itl_ms", "list<float64>", "ms", "Latency of every decode step, in order; element-wise median over repeats"),
    Column("itl_p50_ms", "float64", "ms", "Median inter-token latency over all decode steps of all repeats"),
    Column("itl_p90_ms", "float64", "ms", "90th percentile inter-token latency over all decode steps of all repeats"),
    Column("itl_p99_ms", "float64", "ms", "99th percentile inter-token latency over all decode steps of all repeats"),
    Column("decode_tok_s", "float64", "tok/s", "Decode throughput: batch_size × (gen_len − 1) / decode time"),
    Column("prefill_tok_s", "float64", "tok/s", "Prefill throughput: batch_size × prompt_len / TTFT"),
    Column(
        "e2e_ms",
        "float64",
        "ms",
        "End-to-end time of one generation (prefill and every decode step), median over repeats",
    ),
    Column(
        "ttft_miss_ms",
        "float64",
        "ms",
        "Prefix caching: TTFT when the shared prefix is not cached yet (ttft_ms is then the hit); null otherwise",
    ),
    Column("prefix_hit", "bool", "", "Prefix caching: the measured prefills found the prefix cached; null otherwise"),
    # Prefix reuse across tiers, requests and processes (cache=prefix with host_gb / disk_dir; harness/kv/tiers.py)
    Column(
        "ttft_host_ms",
        "float64",
        "ms",
        "Prefix tiers: TTFT when the prefix's blocks are fetched from the host tier (not in device memory); null: none",
    ),
    Column(
        "ttft_disk_ms",
        "float64",
        "ms",
        "Prefix tiers: TTFT when the prefix's blocks are read from the disk tier's files (in neither memory tier)",
    ),
    Column(
        "prefix_source",
        "string",
        "",
        "Prefix tiers: where the point's first prefill found its prefix: device, host, disk, or computed (a miss)",
    ),
    Column(
        "prefix_bytes_stored", "int64", "bytes", "Prefix tiers: bytes of the prefix's blocks as one tier holds them"
    ),
    Column(
        "prefix_disk_read_gbps",
        "float64",
        "GB/s",
        "Prefix tiers: the bytes its block files held over the time they took to read and check, all the disk loads, GB = 1e9",
    ),
    Column(
        "prefix_rejected_blocks",
        "int64",
        "",
        "Prefix tiers: stored blocks refused in this point (foreign identity, corrupt file): each was a miss",
    ),
    Column(
        "predicted_prefix_load_ms",
        "float64",
        "ms",
        "Analytic: prefix_bytes_stored over the disk tier's stored read GB/s (the ceilings' tier figures)",
    ),
    Column(
        "predicted_prefix_compute_ms",
        "float64",
        "ms",
        "Analytic: the prefix's prefill FLOPs over the measured matmul peak (the roofline's prefill model)",
    ),
    Column("repeats", "int64", "", "Measured repeats, warm-up excluded"),
    Column(
        "n_threads",
        "int64",
        "",
        "CPU threads the loop ran with (make bench-llamacpp: both engines alike); null elsewhere",
    ),
    # Convergence and host noise: whether the figures above can be trusted (harness/measure/timing.py, harness/measure/host_noise.py)
    Column(
        "tpot_samples_ms",
        "list<float64>",
        "ms",
        "Each measured repeat's TPOT, in order (the retry's alone when the point was retried)",
    ),
    Column("ttft_samples_ms", "list<float64>", "ms", "Each measured repeat's TTFT, in order, as tpot_samples_ms"),
    Column(
        "tpot_rse",
        "float64",
        "",
        "Relative standard error of the median TPOT, by bootstrap over the repeats (sd of resampled medians / median)",
    ),
    Column("converged", "bool", "", "tpot_rse fell below target_rse before max_repeats or max_time_s stopped it"),
    Column("stop_reason", "string", "", "What ended the repeats: target (converged), max_repeats or max_time_s"),
    Column(
        "retries",
        "int64",
        "",
        "Measurements repeated because the first did not converge (retry_noisy: once, with twice the budget)",
    ),
    Column(
        "host_steal_frac",
        "float64",
        "",
        "CPU time the hypervisor stole during the measured repeats, share of all CPU time (/proc/stat); null if unread",
    ),
    Column(
        "host_other_cpu_frac",
        "float64",
        "",
        "CPU time other processes used during the measured repeats, share of all cores' time (psutil)",
    ),
    Column("host_busy", "bool", "", "Steal or other processes took a noticeable share of the host while measuring"),
    # Memory
    Column("weights_bytes", "int64", "bytes", "Model parameters, at their stored dtype"),
    Column("kv_bytes_allocated", "int64", "bytes", "KV storage the cache holds, used or not (buffers, whole blocks)"),
    Column("kv_bytes_live", "int64", "bytes", "KV storage the cached tokens actually need, at kv_dtype"),
    Column("kv_scale_bytes", "int64", "bytes", "Of kv_bytes_allocated, the quantization scales (0 for plain dtypes)"),
    Column(
        "kv_bytes_host",
        "int64",
        "bytes",
        "Offload: of kv_bytes_allocated, the part in pinned host memory; null otherwise",
    ),
    Column(
        "kv_bytes_shared",
        "int64",
        "bytes",
        "Prefix caching: KV bytes the shared prefix saves against every sequence holding its own copy",
    ),
    Column(
        "kv_tail_bytes",
        "int64",
        "bytes",
        "Of kv_bytes_allocated, int4's full-precision tail (residual window, incomplete key group); 0 otherwise",
    ),
    Column(
        "kv_waste_fraction",
        "float64",
        "",
        "Share of KV payload storage holding no token at the peak: (allocated - scales - tail - live) / "
        "(allocated - scales - tail)",
    ),
    Column(
        "kv_bytes_predicted",
        "int64",
        "bytes",
        "Analytic KV size: 2 × n_layers × (prompt_len + gen_len) × n_kv_heads × head_dim × bytes(kv_dtype) × batch_size",
    ),
    Column(
        "kv_bytes_planner",
        "int64",
        "bytes",
        "Analytic, the planner's KV bytes for the point's workload (harness.analytic: scales, whole blocks, a window, a "
        "shared prefix, int4's tail): what kv_bytes_allocated should be; null where the planner refuses (mixed lengths)",
    ),
    Column(
        "peak_mem_bytes",
        "int64",
        "bytes",
        "Peak memory of the point, as peak_mem_source says: CPU, peak RSS of its measuring process; CUDA, NVML's "
        "peak for this process, or the allocator's reserved peak where NVML does not list the process",
    ),
    Column(
        "peak_mem_source",
        "string",
        "",
        "Where peak_mem_bytes comes from: rss (CPU), nvml_process (NVML lists this PID with its memory at the "
        "baseline), or torch_reserved (it does not: a container's PID namespace, a failed query; a warning says why)",
    ),
    Column(
        "mem_baseline_bytes",
        "int64",
        "bytes",
        "Memory in use before the model loads: RSS on CPU, NVML device-used on CUDA",
    ),
    Column("torch_peak_allocated_bytes", "int64", "bytes", "torch.cuda.max_memory_allocated (tensors); null on CPU"),
    Column(
        "torch_peak_reserved_bytes", "int64", "bytes", "torch.cuda.max_memory_reserved (caching allocator); null on CPU"
    ),
    Column("nvml_peak_used_bytes", "int64", "bytes", "Peak device memory in use, all processes (NVML); null on CPU"),
    Column("nvml_process_peak_bytes", "int64", "bytes", "Peak device memory used by this process (NVML); null on CPU"),
    # Roofline: the analytic step model (harness/analytic/roofline.py) beside this device's measured ceilings
    Column(
        "flops_per_step",
        "float64",
        "FLOP",
        "Analytic FLOPs of one decode step of the whole batch at the mean decode context (2 per multiply-add)",
    ),
    Column(
        "bytes_per_step",
        "float64",
        "bytes",
        "Analytic bytes one decode step moves: weights + KV read (n_kv_heads, kv_dtype, scales) + KV written + activations",
    ),
    Column("arithmetic_intensity", "float64", "FLOP/byte", "flops_per_step / bytes_per_step (decode)"),
    Column("prefill_arithmetic_intensity", "float64", "FLOP/byte", "Analytic FLOPs / bytes of the prefill"),
    Column("prefill_flops", "float64", "FLOP", "Analytic FLOPs of the prefill of the whole batch"),
    Column("achieved_bw_gbps", "float64", "GB/s", "bytes_per_step / tpot: the bandwidth the measured decode implies"),
    Column("achieved_tflops", "float64", "TFLOP/s", "flops_per_step / tpot"),
    Column(
        "prefill_achieved_tflops",
        "float64",
        "TFLOP/s",
        "prefill_flops / ttft_ms (TTFT also holds the first token's sampling, so this slightly understates it)",
    ),
    Column("bw_util", "float64", "", "achieved_bw_gbps / peak_bw_gbps (over 1: ceilings_stale, or a bug in the model)"),
    Column("flops_util", "float64", "", "achieved_tflops / peak_tflops"),
    Column(
        "bound",
        "string",
        "",
        "memory or compute: whether arithmetic_intensity is below or above the ridge, peak_tflops / peak_bw_gbps",
    ),
    Column(
        "predicted_tpot_ms",
        "float64",
        "ms",
        "Predicted (analytic) TPOT: max(flops_per_step / peak FLOP/s, bytes_per_step / peak bandwidth)",
    ),
    Column(
        "peak_bw_gbps",
        "float64",
        "GB/s",
        "The memory roof the roofline used, measured on this device (bw_roof says which), GB = 1e9",
    ),
    Column(
        "bw_roof",
        "string",
        "",
        "Which bandwidth peak_bw_gbps is: read (a streaming read, what a decode step does) or copy (read + write)",
    ),
    Column("peak_read_bw_gbps", "float64", "GB/s", "This device's measured streaming-read bandwidth (bytes read)"),
    Column("peak_copy_bw_gbps", "float64", "GB/s", "This device's measured copy bandwidth (bytes read + written)"),
    Column(
        "ceilings_stale",
        "bool",
        "",
        "bw_util or flops_util is over 1: the row beat its ceilings, so they are stale (re-measure them) or wrong",
    ),
    Column("peak_tflops", "float64", "TFLOP/s", "This device's measured dense matmul throughput in the compute dtype"),
    Column(
        "critical_batch",
        "float64",
        "",
        "Predicted B*: the smallest batch whose decode step at this context reaches the ridge; null if none does",
    ),
    Column(
        "critical_context",
        "float64",
        "tokens",
        "Predicted S*: beyond this context decode cannot reach the ridge at any batch (inf: never binds)",
    ),
    Column("ceilings_fingerprint", "string", "", "The stored ceilings (results_dir/ceilings/<fingerprint>.json) used"),
    # Profiler: a separate torch.profiler pass over prof_steps decode steps (harness/measure/profile.py)
    # one share per PROFILE_CATEGORIES entry, prof_<category>_frac
    Column("prof_attention_frac", "float64", "", "Share of classified step time in attention"),
    Column("prof_gemm_frac", "float64", "", "Share in matrix multiplies (projections, MLP, lm_head)"),
    Column("prof_norm_elementwise_frac", "float64", "", "Share in norms, RoPE, activations and other elementwise ops"),
    Column("prof_kv_frac", "float64", "", "Share in KV writes, quantize and dequantize, paged gathers"),
    Column("prof_sampling_frac", "float64", "", "Share in sampling (argmax)"),
    Column("prof_other_frac", "float64", "", "Share in everything else; the six shares sum to 1"),
    Column("prof_step_classified_ms", "float64", "ms", "Classified time per profiled step (compare with tpot_ms)"),
    Column("prof_attention_flops", "int64", "FLOP", "Attention FLOPs of one decode step (torch.utils.flop_counter)"),
    Column("prof_total_flops", "int64", "FLOP", "All counted FLOPs of one decode step (torch.utils.flop_counter)"),
    Column("prof_mem_weights_bytes", "int64", "bytes", "Profiler memory view: parameters"),
    Column("prof_mem_kv_bytes", "int64", "bytes", "Profiler memory view: the KV cache's storage"),
    Column(
        "prof_mem_activations_bytes",
        "int64",
        "bytes",
        "Profiler memory view: peak transient allocations during the profiled decode steps",
    ),
    Column("prof_steps", "int64", "", "Decode steps profiled"),
    Column("prof_trace_path", "string", "", "Chrome trace of the profiled pass (profile_trace=true); null otherwise"),
    Column("prof_memory_snapshot_path", "string", "", "CUDA memory snapshot next to the trace; null otherwise"),
    # Energy and validity (CUDA, through NVML; null on CPU)
    Column(
        "energy_j_per_token",
        "float64",
        "J",
        "NVML total-energy delta over the timed generations alone (after the warm-up; prefill included) / the "
        "tokens they generated",
    ),
    Column(
        "mean_power_w",
        "float64",
        "W",
        "Mean board power over the timed generations (that energy delta / their wall time)",
    ),
    Column("sm_clock_mhz_min", "int64", "MHz", "Lowest SM clock sampled during the timed generations"),
    Column("sm_clock_mhz_max", "int64", "MHz", "Highest SM clock sampled during them: far above the min, clocks moved"),
    Column("mem_clock_mhz_min", "int64", "MHz", "Lowest memory clock sampled during the timed generations"),
    Column("mem_clock_mhz_max", "int64", "MHz", "Highest memory clock sampled during them"),
    Column(
        "throttle_reasons",
        "int64",
        "",
        "Bitwise OR of every NVML clock-event (throttle) reason bitmask sampled during the timed generations; 0: none. "
        "Bit 0x1 (GPU idle) marks samples that caught the GPU between kernels; 0x4 (power cap), 0x8 (hardware "
        "slowdown), 0x20 and 0x40 (thermal) mean it throttled",
    ),
    Column(
        "nvml_timed_samples",
        "int64",
        "",
        "NVML samples (every 10 ms) that fell inside the timed generations; 0: too short for clock columns",
    ),
    Column(
        "nvml_error",
        "string",
        "",
        "First NVML error of the point (query: error), or why NVML could not start; null when none (and on CPU)",
    ),
    # Accuracy: lossy points against the exact cache (contiguous, kv_dtype = dtype), teacher-forced on the same
    # tokens: the prompts' own text where they have one (prompt_source sharegpt, text), else the exact cache's greedy
    Column("logit_max_abs_err", "float64", "", "Largest |logit - exact logit| over every step, sequence and token"),
    Column("kl_mean", "float64", "nats", "Mean KL(exact || lossy) of the next-token distributions over all steps"),
    Column("top1_agreement", "float64", "", "Fraction of steps whose argmax equals the exact cache's"),
    Column(
        "accuracy_reference",
        "string",
        "",
        "What kl_mean and top1_agreement compare against when it is not the exact cache of this engine and weights "
        "(contiguous at the compute dtype): a llama.cpp row's is llama.cpp's own run on F32 weights with an f32 KV cache",
    ),
    Column("eval_text", "string", "", "Local text file whose perplexity was measured; null when none"),
    Column(
        "ppl",
        "float64",
        "",
        "Perplexity through this point's cache of eval_text, or of the prompts' own continuation (real checkpoints)",
    ),
    Column("ppl_delta", "float64", "", "ppl minus the exact cache's perplexity on the same text"),
    Column(
        "ppl_source",
        "string",
        "",
        "The text ppl was measured on: eval_text, or the prompts' continuation (sharegpt: ShareGPT replies; text)",
    ),
    # Output
    Column("output_digest", "string", "", "sha256 hex of the generated token ids: equal digests, equal outputs"),
    # Environment
    Column("git_sha", "string", "", "Commit of the harness that produced the row"),
    Column("git_dirty", "bool", "", "Uncommitted changes to tracked files at that commit; null outside a git checkout"),
    Column("host", "string", "", "Host name of the machine"),
    Column(
        "slurm_job_id",
        "string",
        "",
        "The SLURM job that measured the point, as submitit names its folder (<array job>_<task>, else the job id); "
        "null outside SLURM",
    ),
    Column("cpu_model", "string", "", "CPU model name (/proc/cpuinfo), whatever the device"),
    Column(
        "cpu_capability",
        "string",
        "",
        "The vector ISA torch's CPU kernels dispatch to (torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, "
        "AVX512), whatever the device: CPUs of one model name differ in it",
    ),
    Column("device_name", "string", "", "Device model: GPU name, or CPU brand on CPU"),
    Column("device_count", "int64", "", "CUDA devices visible to the process; 1 on CPU"),
    Column("driver_version", "string", "", "NVIDIA driver version (NVML); null on CPU"),
    Column("cuda_version", "string", "", "CUDA version torch was built with (torch.version.cuda); null on CPU"),
    Column("torch_version", "string", "", "torch.__version__"),
    Column("python_version", "string", "", "platform.python_version()"),
    Column("kvbench_version", "string", "", "The installed kvbench package's version"),
    Column("config_json", "string", "", "The point's resolved RunConfig as JSON: diff two rows' with `results diff`"),
    Column("started_at", "string", "", "Start of the measurement, ISO-8601 UTC"),
    Column("schema_version", "int64", "", "SCHEMA_VERSION of the writer; filled in by write_point when absent"),
)


def arrow_schema() -> pa.Schema:
    """The typed Arrow schema of a row; each field carries its unit and description as metadata."""
    return pa.schema(arrow_fields(COLUMNS), metadata={"kvbench.schema_version": str(SCHEMA_VERSION)})


def arrow_fields(columns: tuple[Column, ...]) -> list[pa.Field]:
    return [
        pa.field(
            c.name,
            _ARROW_TYPES[c.type],
            nullable=not c.required,
            metadata={"unit": c.unit, "description": c.description},
        )
        for c in columns
    ]


def columns_markdown() -> str:
    """The column contract as a Markdown table, for the README (between the columns:start/end markers)."""
    lines = ["| Column | Type | Unit | Meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        meaning = c.description.replace("|", r"\|")  # a bare pipe would split the cell
        lines.append(f"| `{c.name}` | {c.type} | {c.unit} | {meaning} |")
    return "\n".join(lines) + "\n"


# One row per context of a capacity run: the OOM frontier measured with real OOMs (experiments/capacity.py,
# frontier_rows) beside the planner's prediction under the same memory cap.
FRONTIER_COLUMNS: tuple[Column, ...] = (
    Column("model", "string", "", "Model preset name"),
    Column("device", "string", "", "cpu or cuda"),
    Column("dtype", "string", "", "Compute dtype of weights and activations"),
    Column("kv_dtype", "string", "", "Storage dtype of the KV cache (kv_dtype=auto resolved to dtype)"),
    Column("cache", "string", "", "KV-cache strategy name"),
    Column("context", "int64", "tokens", "prompt_len + gen_len per sequence: where this frontier was searched"),
    Column("prompt_len", "int64", "tokens", "Prompt tokens per sequence"),
    Column("gen_len", "int64", "tokens", "Tokens generated per sequence"),
    Column("max_memory_gb", "float64", "GiB", "The memory cap every probe ran under"),
    Column(
        "runtime_overhead_bytes",
        "int64",
        "bytes",
        "Runtime memory the planner counts against the cap (CPU: measured; CUDA: 0, the allocator cap excludes it)",
    ),
    Column("predicted_max_batch", "int64", "", "The planner's largest batch under the cap"),
    Column("measured_max_batch", "int64", "", "Largest batch that ran under the cap (0: not even one); null: failed"),
    Column("first_oom_batch", "int64", "", "Smallest batch that ran out of memory (max_batch + 1 when none did)"),
    Column("bisection_step", "int64", "", "first_oom_batch - measured_max_batch when the search stopped"),
    Column("probes", "int64", "", "Points measured (each in its own spawned process) to find the frontier"),
    Column("probe_s", "float64", "s", "Wall time of all the probes"),
    Column("peak_mem_bytes", "int64", "bytes", "Peak memory of the last probe that fit (as the row's peak_mem_bytes)"),
    Column("mem_baseline_bytes", "int64", "bytes", "Memory in use before that probe's model loaded"),
    Column("kv_bytes_allocated", "int64", "bytes", "KV storage that probe's cache held"),
    Column("error", "string", "", "Why the search stopped: a probe that neither ran nor ran out of memory; null: ok"),
    Column("within_step", "bool", "", "The prediction lies within one bisection_step of measured_max_batch"),
    Column(
        "predicted_model_bytes",
        "int64",
        "bytes",
        "The planner's total at measured_max_batch without the runtime, to compare with peak - baseline",
    ),
    Column("mmap_threshold_pinned", "bool", "", "glibc's MALLOC_MMAP_THRESHOLD_ pinned in the probes (see capacity)"),
    Column(
        "rss_error",
        "float64",
        "",
        "(predicted_model_bytes - growth) / growth, growth = peak_mem_bytes - mem_baseline_bytes: the planner's error",
    ),
)


def frontier_arrow_schema() -> pa.Schema:
    """The typed Arrow schema of a frontier table; each field carries its unit and description as metadata."""
    return pa.schema(arrow_fields(FRONTIER_COLUMNS))
