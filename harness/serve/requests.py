"""The request stream a serving run replays: when each request arrives, how long its prompt is, how many tokens it
asks for, and how much of its prompt every request shares.

Modelled on vLLM's benchmark client (vllm/benchmarks/serve.py `get_request`, vllm/benchmarks/datasets.py
`RandomDataset`), with its names where it has them: num_prompts, burstiness, range ratio, max_model_len. The stream
is data, decided before the run: `generate(spec)` draws it from a seed, `read_trace(path)` reads it from a file, and
`prompt_token_ids` turns it into the token ids an engine is fed. Torch-free (numpy only).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.errors import ConfigError

LENGTH_DISTS = ("fixed", "uniform", "lognormal")
TRACE_SUFFIXES = (".jsonl", ".csv")
TRACE_COLUMNS = ("arrival_s", "prompt_len", "output_len")  # required; prefix_len is optional (0)
# One independent random stream per quantity, so that changing one knob leaves the others' draws alone: a qps sweep
# replays the very same prompts and outputs at every rate, and a new length distribution keeps the arrivals.
ARRIVAL_STREAM, PROMPT_STREAM, OUTPUT_STREAM, TOKEN_STREAM = 0, 1, 2, 3
# Rounds of redrawing a lognormal's out-of-range lengths. Its mean lies in range (RequestSpec checks it), so a
# draw mostly lands there; a spec whose range is a sliver around the mean ends in a ConfigError, not a hang.
MAX_REDRAWS = 1000


@dataclass(frozen=True)
class Request:
    """One request of the stream. Lengths in tokens; prompt_len counts the shared prefix."""

    request_id: int  # 0, 1, ... in arrival order
    arrival_s: float  # seconds from the run's start
    prompt_len: int  # tokens, prefix_len of them shared with every request
    output_len: int  # tokens to generate (no EOS stop: the benchmark asks for exactly this many)
    prefix_len: int = 0  # leading prompt tokens shared with every request (a system prompt); 0 when none
    block_hashes: tuple[int, ...] = ()  # a known prompt's whole blocks (block_pool.hash_blocks); (): by prefix_len


@dataclass(frozen=True)
class RequestSpec:
    """A seeded synthetic stream: `num_prompts` requests, gamma-distributed gaps at `qps`, and lengths drawn from
    one distribution per side.

    A length distribution is `<side>_dist` with mean `<side>_len` and `<side>_spread`:
      - fixed: every request has the mean; spread must be 0;
      - uniform: integers uniform in [floor(mean·(1-r)), ceil(mean·(1+r))], at least 1, with r = spread in [0, 1):
        vLLM's --random-range-ratio;
      - lognormal: round(X), X ~ LogNormal(mu, sigma) with sigma = spread > 0 and mu = ln(mean) - sigma²/2, so that
        E[X] = exp(mu + sigma²/2) = mean: the stated mean is the distribution's mean, not its median.

    max_model_len bounds prompt_len + output_len, as a vLLM server does. A server refuses a request over it (HTTP
    400, counted as a failed request) rather than clipping it, so a fixed or uniform stream whose largest pair does
    not fit is refused here, before any work, naming the bound. A lognormal's tail is unbounded, so it has to be cut
    somewhere: its out-of-range draws (a prompt not longer than prefix_len, a pair over max_model_len) are drawn
    again, as vLLM's ShareGPT sampler skips pairs over its length limits; the sample mean then falls below the stated
    mean by the truncated tail's share, negligible while the mean sits well inside the bounds.
    """

    num_prompts: int = 1000  # requests in the stream (vLLM's default)
    qps: float = math.inf  # offered requests/s (vLLM's --request-rate); inf: all arrive at t = 0
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 steadier, inf evenly spaced
    seed: int = 0
    prompt_len: int = 1024  # mean prompt tokens, prefix included (vLLM's random_input_len excludes its prefix)
    prompt_dist: str = "fixed"  # fixed | uniform | lognormal
    prompt_spread: float = 0.0  # uniform: range ratio in [0, 1); lognormal: sigma of ln(length); fixed: 0
    output_len: int = 128  # mean output tokens (vLLM's random_output_len)
    output_dist: str = "fixed"
    output_spread: float = 0.0
    prefix_len: int = 0  # tokens of a system prompt every request starts with; below the shortest prompt
    max_model_len: int = 4096  # the most tokens one request may hold, prompt plus output (ModelArgs.max_seq_len's)

    def __post_init__(self) -> None:
        _check_int("num_prompts", self.num_prompts, low=1)
        if not _is_number(self.qps) or not self.qps > 0:
            raise ConfigError(f"qps: must be > 0 requests/s, or inf (all at once), got {self.qps!r}")
        if not _is_number(self.burstiness) or not self.burstiness > 0:
            raise ConfigError(f"burstiness: must be > 0 (1 = Poisson), or inf (evenly spaced), got {self.burstiness!r}")
        _check_int("seed", self.seed, low=0)
        _check_lengths("prompt", self.prompt_len, self.prompt_dist, self.prompt_spread)
        _check_lengths("output", self.output_len, self.output_dist, self.output_spread)
        _check_int("prefix_len", self.prefix_len, low=0)
        _check_int("max_model_len", self.max_model_len, low=2)
        shortest = self.prompt_len if self.prompt_dist == "lognormal" else self.prompt_bounds[0]
        if self.prefix_len >= shortest:
            which = "mean" if self.prompt_dist == "lognormal" else "shortest"
            raise ConfigError(
                f"prefix_len: must be below the {which} prompt ({shortest} tokens, prompt_dist={self.prompt_dist}), "
                f"got {self.prefix_len}"
            )
        # The largest pair a bounded side can draw must fit; a lognormal side counts its mean (its tail is redrawn).
        needed = self.prompt_bounds[1] + self.output_bounds[1]
        if needed > self.max_model_len:
            raise ConfigError(
                f"max_model_len: must hold the largest prompt_len + output_len ({self.prompt_bounds[1]} + "
                f"{self.output_bounds[1]} = {needed} tokens; a lognormal side counts its mean), got {self.max_model_len}"
            )

    @property
    def prompt_bounds(self) -> tuple[int, int]:
        """(shortest, longest) prompt in tokens; a lognormal's are (prefix_len + 1, its mean)."""
        return _bounds(self.prompt_len, self.prompt_dist, self.prompt_spread, low=self.prefix_len + 1)

    @property
    def output_bounds(self) -> tuple[int, int]:
        """(shortest, longest) output in tokens; a lognormal's are (1, its mean)."""
        return _bounds(self.output_len, self.output_dist, self.output_spread, low=1)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")


def _check_lengths(side: str, mean: object, dist: object, spread: object) -> None:
    """One side's distribution: `<side>_len` (the mean), `<side>_dist`, `<side>_spread`."""
    _check_int(f"{side}_len", mean, low=1)
    if dist not in LENGTH_DISTS:
        raise ConfigError(f"{side}_dist: must be one of {', '.join(LENGTH_DISTS)}, got {dist!r}")
    field = f"{side}_spread"
    if not _is_number(spread) or not math.isfinite(spread):
        raise ConfigError(f"{field}: must be a finite number, got {spread!r}")
    if dist == "fixed" and spread != 0:
        raise ConfigError(
            f"{field}: must be 0 for {side}_dist=fixed (uniform or lognormal take a spread), got {spread}"
        )
    if dist == "uniform" and not 0 <= spread < 1:
        raise ConfigError(f"{field}: must be in [0, 1) for {side}_dist=uniform (vLLM's range ratio), got {spread}")
    if dist == "lognormal" and not spread > 0:
        raise ConfigError(f"{field}: must be > 0 for {side}_dist=lognormal (the sigma of ln length), got {spread}")


def _bounds(mean: int, dist: str, spread: float, *, low: int) -> tuple[int, int]:
    """(shortest, longest) a distribution draws; for a lognormal, (low, mean). Tokens."""
    if dist == "fixed":
        return mean, mean
    if dist == "lognormal":
        return low, mean
    # round() strips float noise: 100 * 0.1 = 10.000000000000002 would otherwise ceil 110 up to 111
    half_width = round(mean * spread, 9)
    return max(math.floor(mean - half_width), 1), math.ceil(mean + half_width)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng((seed, stream))


def inter_arrival_gaps_s(spec: RequestSpec) -> np.ndarray:
    """The raw gaps before each request, seconds, [num_prompts]; gap 0 runs from the run's start to the first.

    Gamma(shape=burstiness, scale=1/(qps·burstiness)), vLLM's get_request: the mean is 1/qps at every burstiness,
    and the coefficient of variation is 1/√burstiness (1 at burstiness 1: exponential gaps, a Poisson process).
    All zero at qps=inf; all 1/qps at burstiness=inf (the gamma's limit).
    """
    if math.isinf(spec.qps):
        return np.zeros(spec.num_prompts)
    if math.isinf(spec.burstiness):
        return np.full(spec.num_prompts, 1.0 / spec.qps)
    scale_s = 1.0 / (spec.qps * spec.burstiness)
    return _rng(spec.seed, ARRIVAL_STREAM).gamma(shape=spec.burstiness, scale=scale_s, size=spec.num_prompts)


def arrival_times_s(spec: RequestSpec) -> np.ndarray:
    """Arrival of each request, seconds from the run's start, [num_prompts], non-decreasing.

    The cumulative gaps, rescaled so that the last request arrives at exactly num_prompts/qps, as vLLM does (without
    a ramp-up): the offered rate is then qps for every seed, instead of drifting by ~1/√num_prompts (10% at 100
    requests), and a stream at 2·qps is the stream at qps, time-compressed by 2. The first request waits a gap too,
    as in vLLM: every request has one gap before it, and the run's duration counts from its start.
    """
    gaps_s = inter_arrival_gaps_s(spec)
    arrivals_s = np.cumsum(gaps_s)
    if arrivals_s[-1] > 0:
        arrivals_s *= (spec.num_prompts / spec.qps) / arrivals_s[-1]
    return arrivals_s


def _draw(mean: int, dist: str, spread: float, *, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` integer lengths >= 1 from one distribution (RequestSpec's docstring), int64."""
    if dist == "fixed":
        return np.full(size, mean, dtype=np.int64)
    if dist == "uniform":
        low, high = _bounds(mean, dist, spread, low=1)
        return rng.integers(low, high + 1, size=size, dtype=np.int64)  # both ends included, as vLLM draws
    sigma = spread
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma²))] = exp(mu + sigma²/2) = mean
    return np.maximum(np.rint(rng.lognormal(mean=mu, sigma=sigma, size=size)), 1).astype(np.int64)


def sample_lengths(spec: RequestSpec) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), tokens, [num_prompts] each, int64. A lognormal side's draws that break a bound
    (a prompt not above prefix_len, a pair over max_model_len) are drawn again; a bounded side always fits."""
    n = spec.num_prompts
    prompt_rng, output_rng = _rng(spec.seed, PROMPT_STREAM), _rng(spec.seed, OUTPUT_STREAM)
    prompts = _draw(spec.prompt_len, spec.prompt_dist, spec.prompt_spread, size=n, rng=prompt_rng)
    outputs = _draw(spec.output_len, spec.output_dist, spec.output_spread, size=n, rng=output_rng)
    for redraw in range(MAX_REDRAWS + 1):
        bad = (prompts <= spec.prefix_len) | (prompts + outputs > spec.max_model_len)
        if not bad.any():
            return prompts, outputs
        if redraw == MAX_REDRAWS:
            break
        count = int(bad.sum())
        if spec.prompt_dist == "lognormal":
            prompts[bad] = _draw(spec.prompt_len, "lognormal", spec.prompt_spread, size=count, rng=prompt_rng)
        if spec.output_dist == "lognormal":
            outputs[bad] = _draw(spec.output_len, "lognormal", spec.output_spread, size=count, rng=output_rng)
    raise ConfigError(
        f"max_model_len: {int(bad.sum())} of {n} lognormal draws still fall outside prefix_len={spec.prefix_len} < "
        f"prompt_len, prompt_len + output_len <= {spec.max_model_len} after {MAX_REDRAWS} redraws; "
        "lower the spread or the means, or raise max_model_len"
    )


def generate(spec: RequestSpec) -> list[Request]:
    """The stream `spec` describes, in arrival order. Deterministic: the same spec gives the same list."""
    arrivals_s = arrival_times_s(spec)
    prompts, outputs = sample_lengths(spec)
    return [
        Request(
            request_id=index,
            arrival_s=float(arrivals_s[index]),
            prompt_len=int(prompts[index]),
            output_len=int(outputs[index]),
            prefix_len=spec.prefix_len,
        )
        for index in range(spec.num_prompts)
    ]


def _trace_int(where: str, name: str, value: object, *, low: int) -> int:
    """An integer field of a trace line: a JSON integer, an integral float or a CSV string of one."""
    what = "a positive integer" if low == 1 else f"an integer >= {low}"
    try:
        number = float(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or not number.is_integer() or number < low:
        raise ConfigError(f"{where}: {name} must be {what}, got {value!r}")
    return int(number)


def _trace_request(where: str, record: dict, request_id: int, *, max_model_len: int | None) -> Request:
    for name in TRACE_COLUMNS:
        if record.get(name) in (None, ""):
            raise ConfigError(f"{where}: missing {name}; a line needs {', '.join(TRACE_COLUMNS)} (prefix_len optional)")
    arrival = record["arrival_s"]
    try:
        arrival_s = float(arrival) if isinstance(arrival, str | int | float) and not isinstance(arrival, bool) else -1
    except ValueError:
        arrival_s = -1.0
    if not (math.isfinite(arrival_s) and arrival_s >= 0):
        raise ConfigError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    prompt_len = _trace_int(where, "prompt_len", record["prompt_len"], low=1)
    output_len = _trace_int(where, "output_len", record["output_len"], low=1)
    prefix = record.get("prefix_len")
    prefix_len = 0 if prefix in (None, "") else _trace_int(where, "prefix_len", prefix, low=0)
    if prefix_len >= prompt_len:
        raise ConfigError(f"{where}: prefix_len must be below prompt_len={prompt_len}, got {prefix_len}")
    if max_model_len is not None and prompt_len + output_len > max_model_len:
        raise ConfigError(
            f"{where}: prompt_len + output_len = {prompt_len + output_len} tokens, over max_model_len={max_model_len}"
        )
    return Request(
        request_id=request_id, arrival_s=arrival_s, prompt_len=prompt_len, output_len=output_len, prefix_len=prefix_len
    )


def _trace_records(path: Path) -> list[tuple[int, object]]:
    """(1-based line number, parsed record) per request line: a JSON value, or a CSV row as a dict."""
    text = path.read_text()
    if path.suffix.lower() == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # a blank line holds no request
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"trace: {path} line {number}: not valid JSON ({exc.msg})") from None
        return records
    reader = csv.DictReader(text.splitlines())
    missing = [name for name in TRACE_COLUMNS if name not in (reader.fieldnames or [])]
    if reader.fieldnames and missing:
        raise ConfigError(
            f"trace: {path} line 1: the header lacks {', '.join(missing)}; it needs {', '.join(TRACE_COLUMNS)} "
            "(prefix_len optional)"
        )
    return [(reader.line_num, row) for row in reader if any(cell not in (None, "") for cell in row.values())]


def read_trace(path: str | Path, *, max_model_len: int | None = None) -> list[Request]:
    """The requests of a trace file, request_id by line order.

    JSONL (one object a line) or CSV (a header row), by suffix, with the columns arrival_s (seconds from the run's
    start), prompt_len, output_len and optionally prefix_len (0 when absent); other keys are ignored, so a trace
    can carry its own. Lines must come in arrival order: an earlier arrival after a later one is refused, not
    sorted, because such a file is most often two traces concatenated, and because request_id then is the FCFS
    order, as generate() gives it. Every fault is one line naming the file and the 1-based line.
    """
    path = Path(path)
    if path.suffix.lower() not in TRACE_SUFFIXES:
        raise ConfigError(f"trace: {path}: the suffix must be one of {', '.join(TRACE_SUFFIXES)}, got {path.suffix!r}")
    if not path.is_file():
        raise ConfigError(f"trace: {path}: no such file")
    requests: list[Request] = []
    for number, record in _trace_records(path):
        where = f"trace: {path} line {number}"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: must be a JSON object with {', '.join(TRACE_COLUMNS)}, got {record!r}")
        request = _trace_request(where, record, len(requests), max_model_len=max_model_len)
        if requests and request.arrival_s < requests[-1].arrival_s:
            raise ConfigError(
                f"{where}: arrival_s {request.arrival_s} is before the previous line's {requests[-1].arrival_s}; "
                "lines must be in arrival order"
            )
        requests.append(request)
    if not requests:
        raise ConfigError(f"trace: {path}: holds no requests")
    return requests


def prompt_token_ids(
    requests: Sequence[Request], *, vocab_size: int, seed: int = 0, text_ids: Sequence[int] | None = None
) -> list[list[int]]:
    """Each request's prompt as token ids, [prompt_len] each.

    A request's first prefix_len ids are the first prefix_len ids of one shared system prompt (as long as the
    longest prefix), so a prefix cache can hit across requests; the rest are its own. Without `text_ids` they are
    uniform in [0, vocab_size), seeded (special ids included: the benchmark generates exactly output_len tokens,
    never stopping at EOS). With `text_ids` (a tokenized local text, 1-D) the shared prompt is the text's start,
    and each request's own part is a window of the text at a seeded offset: two requests drawing the same offset
    share more than the prefix, with probability 1/(len(text_ids) - window + 1) per pair.
    """
    _check_int("vocab_size", vocab_size, low=1)
    _check_int("seed", seed, low=0)
    if not requests:
        return []
    rng = _rng(seed, TOKEN_STREAM)
    shared_len = max(request.prefix_len for request in requests)
    if text_ids is None:
        shared = rng.integers(0, vocab_size, size=shared_len)
        own = [rng.integers(0, vocab_size, size=r.prompt_len - r.prefix_len) for r in requests]
    else:
        text = np.asarray(text_ids)
        if text.ndim != 1 or not np.issubdtype(text.dtype, np.integer):
            raise ConfigError(f"text_ids: must be a 1-D sequence of integer token ids, got {text.dtype} {text.shape}")
        longest = max(request.prompt_len for request in requests)
        if text.size < longest:
            raise ConfigError(
                f"text_ids: {text.size} tokens, shorter than the longest prompt ({longest} tokens); give a longer text"
            )
        if text.min() < 0 or text.max() >= vocab_size:
            bad = int(text.min()) if text.min() < 0 else int(text.max())
            raise ConfigError(f"text_ids: ids must lie in [0, vocab_size={vocab_size}), got {bad}")
        shared = text[:shared_len]
        own = []
        for request in requests:
            window = request.prompt_len - request.prefix_len
            offset = int(rng.integers(0, text.size - window + 1))
            own.append(text[offset : offset + window])
    return [
        np.concatenate([shared[: request.prefix_len], part]).astype(np.int64).tolist()
        for request, part in zip(requests, own, strict=True)
    ]


def describe(requests: Sequence[Request]) -> dict:
    """What a stream offers: counts, lengths in tokens, its span in seconds and its offered rate in requests/s
    (num_requests / the last arrival, as the first request waits a gap; inf when all arrive at 0)."""
    if not requests:
        raise ConfigError("requests: the stream is empty")
    prompts = np.array([request.prompt_len for request in requests])
    outputs = np.array([request.output_len for request in requests])
    last_arrival_s = max(request.arrival_s for request in requests)
    return {
        "num_requests": len(requests),
        "last_arrival_s": last_arrival_s,
        "offered_qps": len(requests) / last_arrival_s if last_arrival_s > 0 else math.inf,
        "mean_prompt_len": float(prompts.mean()),
        "mean_output_len": float(outputs.mean()),
        "max_prompt_len": int(prompts.max()),
        "max_output_len": int(outputs.max()),
        "max_total_len": int((prompts + outputs).max()),
        "total_prompt_tokens": int(prompts.sum()),
        "total_output_tokens": int(outputs.sum()),
        "max_prefix_len": max(request.prefix_len for request in requests),
    }
