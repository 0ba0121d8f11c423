"""Chat sessions from real conversations (`dataset=sharegpt-multiturn`): each conversation is a session, each of
its human turns a request whose prompt is the whole history so far, through the tokenizer's chat template.

The workload vLLM's multi-turn serving benchmark (benchmarks/multi_turn/benchmark_serving_multi_turn.py) and
SGLang's (benchmark/hicache/bench_multiturn.py) measure: a later turn repeats every token of the one before it, so
a prefix cache serves it mostly from blocks already computed, and the pool's eviction decides how much of that
survives between turns.

The rules:
  - conversations are shuffled as dataset=sharegpt shuffles them (harness.serve.dataset: those under two turns set
    aside, then random.Random(seed).shuffle), and taken in that order until num_sessions are kept;
  - a session's turns are the conversation's (human, reply) pairs from its first human turn on, while the roles
    alternate, at most max_turns of them;
  - turn k's prompt ids are apply_chat_template(messages, add_generation_prompt=True) over the user and
    assistant messages up to and including turn k's user message, where the earlier replies are the dataset's,
    not the model's: every strategy then serves the very same prompt ids, whatever it generated before;
  - output_len is the reply's token count (encode, as dataset=sharegpt counts it) or the fixed output_len;
  - a turn breaks dataset=sharegpt's rules (harness.serve.dataset.drop_reason: a prompt or reply under 4 tokens, a
    turn over max_model_len) ends its session there: that turn and those after it are counted in cut_turns under
    its reason (the history only grows, so a later turn would be over max_model_len too); a session whose first
    turn breaks them is dropped, counted in `dropped` as dataset=sharegpt counts a conversation;
  - session i starts at the synthetic stream's i-th arrival (harness.serve.requests.arrival_times_s: qps,
    burstiness, seed), and its turn k+1 arrives think time after turn k finished (the closed loop: engine.serve's
    next_turn); the think times are exponential with mean think_time_s, from their own seeded stream.

A chat template normally renders history unchanged, so turn k's prompt is a token prefix of turn k+1's (the
SmolLM2 tokenizer: all 2,233 follow-up turns of the first 1,000 packaged conversations, 8 turns at most). Where a
template does not (one that drops earlier turns' reasoning, say, or a BPE merge across the boundary), the ids are
served as the template gives them: the chained block hashes then match only up to the first block that differs,
which is what a server's prefix cache would find too; prefix_breaks counts those turns, and one warning says so.
Torch-free; the tokenizer is injected (any object with apply_chat_template and encode; load_tokenizer gives a
checkpoint's own).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from harness.errors import ConfigError
from harness.serve.block_pool import hash_blocks
from harness.serve.dataset import DROP_REASONS, HUMAN_ROLES, MIN_LEN, check_enough, drop_reason
from harness.serve.metrics import MS_PER_S, RequestRecord
from harness.serve.requests import Request, RequestSpec, arrival_times_s
from harness.serve.sharegpt import Conversation

log = logging.getLogger(__name__)

THINK_STREAM = 4  # the think times' random stream, after harness.serve.requests' four (arrival .. token)
TTFT_PERCENTILES = (50, 99)  # the run row's TTFT by turn


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool, tokenize: bool): ...

    def encode(self, text: str) -> list[int]: ...


def check_session_knobs(*, max_turns: object, think_time_s: object) -> None:
    """max_turns and think_time_s, one line each: the config checks them before anything is read or built."""
    if max_turns is not None and (not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1):
        raise ConfigError(f"max_turns: must be an integer >= 1, or null (every turn), got {max_turns!r}")
    number = isinstance(think_time_s, int | float) and not isinstance(think_time_s, bool)
    if not number or not math.isfinite(think_time_s) or think_time_s < 0:
        raise ConfigError(f"think_time_s: must be a finite number of seconds >= 0 (the mean), got {think_time_s!r}")


@dataclass(frozen=True)
class Session:
    """One conversation as served: its turns' prompt ids and output lengths, its start and its think times."""

    session_id: int  # 0, 1, ... in start order
    start_s: float  # when its first turn arrives, seconds from the run's start
    prompt_ids: tuple[tuple[int, ...], ...]  # [turns][prompt_len of the turn]
    output_lens: tuple[int, ...]  # [turns], tokens
    think_times_s: tuple[float, ...]  # [turns - 1]: before turn 2, 3, ...
    first_request_id: int  # its turn k (from 0) is request first_request_id + k


@dataclass(frozen=True)
class Sessions:
    """The sessions of a run, with what the sampling passed over. Request ids are by (session, turn), fixed before
    the run, so that two strategies' rows pair up by id; a turn's arrival_s is only known once the turn before it
    has finished (next_turn)."""

    sessions: tuple[Session, ...]
    block_size: int  # the pool's: the prompts' block hashes are over blocks of this many tokens
    dropped: dict[str, int] = field(default_factory=dict)  # conversations, by reason (DROP_REASONS)
    cut_turns: dict[str, int] = field(default_factory=dict)  # turns left out of kept sessions, by reason
    prefix_breaks: int = 0  # follow-up turns whose prompt is not the turn before's prompt plus more tokens

    def _request(self, session: Session, turn: int, arrival_s: float) -> Request:
        ids = session.prompt_ids[turn]
        return Request(request_id=session.first_request_id + turn, arrival_s=arrival_s, prompt_len=len(ids),
                       output_len=session.output_lens[turn], block_hashes=hash_blocks(ids, self.block_size))  # fmt: skip

    def all_turns(self) -> tuple[list[Request], list[list[int]]]:
        """Every turn's request and prompt ids, each at its session's start (for the checks before a run: every
        turn must fit the pool alone)."""
        requests = [self._request(s, turn, s.start_s) for s in self.sessions for turn in range(len(s.output_lens))]
        return requests, [list(ids) for s in self.sessions for ids in s.prompt_ids]

    def first_turns(self) -> tuple[list[Request], list[list[int]]]:
        """The requests the run starts with: each session's first turn, at the session's start."""
        return [self._request(s, 0, s.start_s) for s in self.sessions], [list(s.prompt_ids[0]) for s in self.sessions]

    @functools.cached_property
    def _first_ids(self) -> list[int]:
        return [session.first_request_id for session in self.sessions]  # ascending, as the sessions

    def locate(self, request_id: int) -> tuple[Session, int]:
        """(its session, its turn from 0)."""
        session = self.sessions[bisect.bisect_right(self._first_ids, request_id) - 1]
        turn = request_id - session.first_request_id
        if request_id < 0 or turn >= len(session.output_lens):
            raise KeyError(request_id)
        return session, turn

    def next_turn(self, record: RequestRecord) -> tuple[Request, list[int]] | None:
        """The turn after a finished one, arriving its think time after record.finished_s; None after the last."""
        session, turn = self.locate(int(record.request_id))
        if turn + 1 == len(session.output_lens):
            return None
        arrival_s = record.finished_s + session.think_times_s[turn]
        return self._request(session, turn + 1, arrival_s), list(session.prompt_ids[turn + 1])

    def request_columns(self, request_id: int) -> dict:
        """metrics.request_row's session columns: its session and its turn, from 1."""
        session, turn = self.locate(request_id)
        return {"session_id": session.session_id, "turn": turn + 1}

    def ttft_ms_by_turn(self, records: Sequence[RequestRecord]) -> str:
        """The run row's TTFT by turn, as JSON: {"<turn>": {"count": n, "p50": ms, "p99": ms}, ...}, turns from 1
        (numpy's linear percentiles, as run_metrics'); one string, since the turns a run reaches vary."""
        by_turn: dict[int, list[float]] = {}
        for record in records:
            turn = self.locate(int(record.request_id))[1] + 1
            by_turn.setdefault(turn, []).append(record.ttft_s * MS_PER_S)
        figures = {
            str(turn): {"count": len(ttfts)}
            | {f"p{p}": float(np.percentile(np.asarray(ttfts), p)) for p in TTFT_PERCENTILES}
            for turn, ttfts in sorted(by_turn.items())
        }
        return json.dumps(figures)


def conversation_turns(conversation: Conversation) -> list[tuple[str, str]]:
    """(user text, reply) pairs from the first human turn on, while a human turn is followed by a reply."""
    turns = conversation.turns
    index = next((i for i, (role, _) in enumerate(turns) if role in HUMAN_ROLES), len(turns))
    pairs = []
    while index + 1 < len(turns) and turns[index][0] in HUMAN_ROLES and turns[index + 1][0] not in HUMAN_ROLES:
        pairs.append((turns[index][1], turns[index + 1][1]))
        index += 2
    return pairs


def chat_ids(tokenizer: ChatTokenizer, messages: list[dict]) -> list[int]:
    """The template's ids for messages, ready for the assistant's reply. transformers 5 returns a BatchEncoding,
    4 a list; a tokenizer without a template is one line."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except ValueError as exc:  # transformers: "Cannot use chat template functions because ... is not set"
        raise ConfigError(
            f"weights: the tokenizer has no chat template ({str(exc).splitlines()[0][:80]}); allowed: a checkpoint "
            "whose tokenizer has one, for dataset=sharegpt-multiturn"
        ) from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def sample_sessions(
    conversations: Sequence[Conversation],
    *,
    tokenizer: ChatTokenizer,
    num_sessions: int,
    seed: int,
    max_model_len: int,
    block_size: int,
    output_len: int | None = None,
    max_turns: int | None = None,
    think_time_s: float = 0.0,
    qps: float = float("inf"),
    burstiness: float = 1.0,
) -> Sessions:
    """num_sessions sessions from `conversations` by the module's rules; deterministic for a seed and a tokenizer.

    A ConfigError, one line, when no conversation gives a session (`dataset`) or fewer than num_sessions do
    (`num_prompts`), each with the counts dropped by reason."""
    check_session_knobs(max_turns=max_turns, think_time_s=think_time_s)
    spec = RequestSpec(num_prompts=num_sessions, qps=qps, burstiness=burstiness, seed=seed, prompt_len=1,
                       output_len=1, max_model_len=max(max_model_len, 2))  # fmt: skip
    dropped, cut_turns = dict.fromkeys(DROP_REASONS, 0), dict.fromkeys(DROP_REASONS, 0)
    eligible = [conversation for conversation in conversations if len(conversation.turns) >= 2]
    dropped["no_reply"] = len(conversations) - len(eligible)
    random.Random(seed).shuffle(eligible)
    kept: list[tuple[list[list[int]], list[int]]] = []  # (prompt ids per turn, output_len per turn) per session
    prefix_breaks = 0
    for conversation in eligible:
        if len(kept) == num_sessions:
            break
        pairs = conversation_turns(conversation)[:max_turns]
        if not pairs:
            dropped["no_reply"] += 1
            continue
        prompts, outputs, messages, reason = [], [], [], None
        for user, reply in pairs:
            messages.append({"role": "user", "content": user})
            ids = chat_ids(tokenizer, messages)
            wanted = len(tokenizer.encode(reply)) if output_len is None else output_len
            reason = drop_reason(len(ids), wanted, fixed_output=output_len is not None, max_model_len=max_model_len)
            if reason is not None:
                break
            prefix_breaks += bool(prompts) and ids[: len(prompts[-1])] != prompts[-1]
            prompts.append(ids)
            outputs.append(wanted)
            messages.append({"role": "assistant", "content": reply})
        if not prompts:
            dropped[reason] += 1
            continue
        if reason is not None:
            cut_turns[reason] += len(pairs) - len(prompts)
        kept.append((prompts, outputs))
    rules = f"prompt and reply >= {MIN_LEN} tokens, a first turn's prompt + output <= max_model_len={max_model_len}"
    check_enough(len(kept), num_sessions, conversations=len(conversations), dropped=dropped, rules=rules,
                 passing="give a session", unit=" (sessions)")  # fmt: skip
    if prefix_breaks:
        log.warning("%d follow-up turns are not a token prefix of the next: the chat template re-renders the "
                    "history there, and the prefix cache shares only the blocks before the change", prefix_breaks)  # fmt: skip
    starts_s = arrival_times_s(spec)
    think = np.random.default_rng((seed, THINK_STREAM))
    sessions, first_id = [], 0
    for index, (prompts, outputs) in enumerate(kept):
        # numpy's exponential takes the mean (its scale); a mean of 0 gives 0 s, the next turn at once
        gaps_s = (
            think.exponential(think_time_s, size=len(outputs) - 1) if think_time_s > 0 else [0.0] * (len(outputs) - 1)
        )
        sessions.append(Session(session_id=index, start_s=float(starts_s[index]),
                                prompt_ids=tuple(tuple(ids) for ids in prompts), output_lens=tuple(outputs),
                                think_times_s=tuple(float(g) for g in gaps_s), first_request_id=first_id))  # fmt: skip
        first_id += len(outputs)
    return Sessions(sessions=tuple(sessions), block_size=block_size, dropped=dropped, cut_turns=cut_turns,
                    prefix_breaks=prefix_breaks)  # fmt: skip
