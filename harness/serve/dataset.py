"""A request stream sampled from real conversations (`dataset=sharegpt`), the way `vllm bench serve` samples ShareGPT.

vLLM's rules (vllm/benchmarks/datasets.py, ShareGPTDataset.load_data and .sample; vllm/benchmarks/dataset_utils.py,
is_valid_sequence), mirrored here:
  - conversations with fewer than two turns are set aside, then the rest shuffled with Python's random seeded by
    `seed` (random.seed(seed); random.shuffle(data) in vLLM: the same permutation as random.Random(seed).shuffle);
  - in that order, each conversation gives one request until num_prompts are kept: the prompt is a turn's text, its
    token count the prompt_len (the tokenizer's encode, special tokens included, as vLLM's tokenizer(prompt) is),
    and output_len is the reply's token count, or a fixed output_len for every request (vLLM's
    --sharegpt-output-len, which also skips the short-output check);
  - a pair is dropped when its prompt or (unless fixed) its reply is under 4 tokens (is_valid_sequence's min_len).
Where this differs, and why:
  - the prompt is the first human turn and the reply the turn after it (vLLM takes turns 0 and 1 whatever their
    roles; a third of ShareGPT V3 records open with a gpt turn, which would make a model reply the prompt);
  - a pair over max_model_len (prompt plus output) is dropped; vLLM's fixed 1024-token prompt and 2048-token pair
    limits are its defaults standing in for a model's context, which max_model_len states here;
  - fewer pairs than num_prompts is refused rather than oversampled: vLLM repeats random picks, and a repeated
    prompt is a prefix-cache hit no real stream would give.
The arrivals are the synthetic stream's (harness.serve.requests.arrival_times_s): the same seed, qps and burstiness
give the same arrival times as a `dataset=random` run. Torch-free; the tokenizer is injected (any object with
encode(text) -> list[int]; load_tokenizer gives a checkpoint's own).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness.errors import ConfigError
from harness.serve.requests import Request, RequestSpec, arrival_times_s
from harness.serve.sharegpt import Conversation

DATASETS = ("random", "sharegpt", "sharegpt-multiturn")  # the last: harness.serve.multiturn
MIN_LEN = 4  # tokens: vLLM's is_valid_sequence min_len, for the prompt and the reply
HUMAN_ROLES = ("human", "user")  # ShareGPT's "from" of a person's turn; the rest ("gpt", "system", ...) are not
# Why a conversation gave no request, in the order they are tested; each dropped one counts under its first reason.
DROP_REASONS = ("no_reply", "prompt_too_short", "output_too_short", "too_long")
# A checkpoint folder holds a tokenizer when it has one of these (transformers' AutoTokenizer reads them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Sample:
    """The stream sampled from a dataset: the requests in arrival order, their prompts as token ids, and how many
    conversations were passed over, by reason (DROP_REASONS; those under two turns before the shuffle, the rest
    among the conversations looked at before num_prompts were kept)."""

    requests: list[Request]
    prompt_ids: list[list[int]]  # [num_prompts][prompt_len]
    dropped: dict[str, int] = field(default_factory=dict)


def dataset_columns(
    dataset: str,
    *,
    sha256: str | None = None,
    dropped: dict[str, int] | None = None,
    cut_turns: dict[str, int] | None = None,
    ttft_ms_by_turn: str | None = None,
) -> dict:
    """The run row's dataset columns (harness.serve.columns): where the requests came from, the file's digest and
    the drops by reason; null digest and drops for a stream not sampled from a file (random, trace). Sessions
    (sharegpt-multiturn) add the turns cut by reason and the TTFT by turn, null for every other stream."""
    counts = dict.fromkeys(DROP_REASONS) if dropped is None else {reason: dropped[reason] for reason in DROP_REASONS}
    cut = dict.fromkeys(DROP_REASONS) if cut_turns is None else {reason: cut_turns[reason] for reason in DROP_REASONS}
    return (
        {"dataset": dataset, "dataset_sha256": sha256}
        | {f"dataset_dropped_{r}": n for r, n in counts.items()}
        | {f"dataset_cut_turns_{r}": n for r, n in cut.items() if r != "no_reply"}
        | {"ttft_ms_by_turn": ttft_ms_by_turn}
    )


def prompt_and_reply(conversation: Conversation) -> tuple[str, str] | None:
    """(the first human turn, the turn after it), or None when there is no human turn with a reply after it."""
    for index, (role, text) in enumerate(conversation.turns[:-1]):
        if role in HUMAN_ROLES:
            reply_role, reply = conversation.turns[index + 1]
            return (text, reply) if reply_role not in HUMAN_ROLES else None
    return None


def sample_sharegpt(
    conversations: Sequence[Conversation],
    *,
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int,
    max_model_len: int,
    output_len: int | None = None,
    qps: float = float("inf"),
    burstiness: float = 1.0,
) -> Sample:
    """num_prompts requests from `conversations` by the module's rules; deterministic for a seed and a tokenizer.

    A ConfigError, one line, when no conversation passes the filters (`dataset`) or fewer than num_prompts do
    (`num_prompts`), each with the counts dropped by reason."""
    if output_len is not None and (not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1):
        raise ConfigError(
            f"sharegpt_output_len: must be an integer >= 1, or null (the reply's length), got {output_len!r}"
        )
    # The arrivals as the synthetic stream draws them (lengths unused: 1 token each); validates the rate knobs too.
    spec = RequestSpec(num_prompts=num_prompts, qps=qps, burstiness=burstiness, seed=seed, prompt_len=1,
                       output_len=1, max_model_len=max(max_model_len, 2))  # fmt: skip
    dropped = dict.fromkeys(DROP_REASONS, 0)
    eligible = [conversation for conversation in conversations if len(conversation.turns) >= 2]
    dropped["no_reply"] = len(conversations) - len(eligible)
    random.Random(seed).shuffle(eligible)
    kept: list[tuple[list[int], int]] = []  # (prompt ids, output_len) per request
    for conversation in eligible:
        if len(kept) == num_prompts:
            break
        pair = prompt_and_reply(conversation)
        if pair is None:
            dropped["no_reply"] += 1
            continue
        prompt_ids = list(tokenizer.encode(pair[0]))
        wanted = len(tokenizer.encode(pair[1])) if output_len is None else output_len
        reason = drop_reason(len(prompt_ids), wanted, fixed_output=output_len is not None, max_model_len=max_model_len)
        if reason is not None:
            dropped[reason] += 1
            continue
        kept.append((prompt_ids, wanted))
    rules = f"prompt and reply >= {MIN_LEN} tokens, prompt + output <= max_model_len={max_model_len}"
    check_enough(len(kept), num_prompts, conversations=len(conversations), dropped=dropped, rules=rules,
                 passing="pass the filters")  # fmt: skip
    arrivals_s = arrival_times_s(spec)
    requests = [
        Request(request_id=index, arrival_s=float(arrivals_s[index]), prompt_len=len(ids), output_len=wanted)
        for index, (ids, wanted) in enumerate(kept)
    ]
    return Sample(requests=requests, prompt_ids=[ids for ids, _ in kept], dropped=dropped)


def check_enough(kept: int, wanted: int, *, conversations: int, dropped: dict[str, int], rules: str, passing: str,
                 unit: str = "") -> None:  # fmt: skip
    """One ConfigError line when no conversation passes the filters (`dataset`) or fewer than `wanted` do
    (`num_prompts`), with the drops by reason and the rules that made them."""
    counts = ", ".join(f"{reason} {count}" for reason, count in dropped.items())
    if not kept:
        raise ConfigError(
            f"dataset: every one of {conversations} conversations is filtered out ({counts}); allowed: a "
            f"dataset with a human turn and its reply, {rules}"
        )
    if kept < wanted:
        raise ConfigError(
            f"num_prompts: only {kept} of {conversations} conversations {passing} ({rules}; {counts}); allowed: "
            f"num_prompts <= {kept}{unit}"
        )


def drop_reason(prompt_len: int, output_len: int, *, fixed_output: bool, max_model_len: int) -> str | None:
    """vLLM's is_valid_sequence, with max_model_len for its length limits; None when the pair is kept."""
    if prompt_len < MIN_LEN:
        return "prompt_too_short"
    if not fixed_output and output_len < MIN_LEN:
        return "output_too_short"
    if prompt_len + output_len > max_model_len:
        return "too_long"
    return None


def check_vocab(prompt_ids: list[list[int]], *, vocab_size: int) -> None:
    """A tokenizer's ids must index the model's embedding: one that is not the checkpoint's is refused here."""
    top = max(max(ids) for ids in prompt_ids)
    if top >= vocab_size:
        raise ConfigError(
            f"weights: the tokenizer gives id {top}, past the model's vocab_size={vocab_size}; allowed: a checkpoint "
            "whose tokenizer matches its model"
        )


def check_tokenizer_dir(weights: str, dataset: str = "sharegpt") -> Path:
    """The checkpoint folder a dataset's text is tokenized with: `weights`, when it holds a tokenizer."""
    folder = Path(weights)
    if weights == "dummy" or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"dataset: {dataset} needs a tokenizer; allowed: weights=<checkpoint dir with a tokenizer>")
    return folder


def load_tokenizer(weights: str) -> Tokenizer:
    """The checkpoint's own tokenizer (transformers' AutoTokenizer), so that prompt ids are the model's."""
    folder = check_tokenizer_dir(weights)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"weights: {folder}'s tokenizer does not load ({first_line}); allowed: a checkpoint dir with a tokenizer"
        ) from None
