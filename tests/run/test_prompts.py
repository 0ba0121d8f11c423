"""A point's prompts: seeded random ids, or real text through the model's tokenizer (harness.run.prompts)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from harness.config import RunConfig
from harness.errors import ConfigError
from harness.run import prompts
from harness.run.point import run_point
from harness.serve.sharegpt import read_sharegpt

FAST = dict(warmup=0, min_repeats=1, max_repeats=1, isolate=False, profile=False, roofline=False)
WORDS = [f"w{i}" for i in range(1, 100)]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A checkpoint folder holding only a tokenizer: word-level over w0..w99 plus the chat roles, ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["<unk>", "user", "assistant", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def conversation(index: int, *, human_words: int, reply_words: int) -> dict:
    """A ShareGPT record whose human turn and reply are runs of distinct words, so a cut can be read off its ids."""
    human = " ".join(WORDS[(index + k) % 40] for k in range(human_words))
    reply = " ".join(WORDS[40 + (index + k) % 50] for k in range(reply_words))
    turns = [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]
    return {"id": f"c{index}", "conversations": turns}


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    """Eight conversations long enough for a 24-token prompt and 8 generated tokens, and two that are not."""
    records = [conversation(i, human_words=30, reply_words=12) for i in range(8)]
    records += [conversation(8, human_words=3, reply_words=2), {"id": "one-turn", "conversations": []}]
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


def make(source, directory, **kwargs):
    defaults = dict(weights=str(directory), vocab_size=200, batch_size=4, prompt_len=24, gen_len=8)
    return prompts.make_prompts(source, **(defaults | kwargs))


def test_random_ids_are_the_seeded_ids_every_older_point_decoded():
    got = prompts.make_prompts("auto", weights="dummy", vocab_size=50, batch_size=3, prompt_len=10, gen_len=4,
                               prefix_len=4, seed=7)  # fmt: skip
    expected = torch.randint(50, (3, 10), generator=torch.Generator().manual_seed(7))
    expected[:, :4] = expected[0, :4].clone()
    assert got.source == "random" and got.continuation is None and got.sha256 is None
    assert torch.equal(got.ids, expected)


def test_sharegpt_prompts_end_where_a_reply_begins_and_continue_with_it(chat_tokenizer_dir, sharegpt_file):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    got = make("auto", chat_tokenizer_dir, dataset_path=str(sharegpt_file), seed=3)
    assert got.source == "sharegpt"  # auto, for a checkpoint with a tokenizer
    assert got.sha256 == hashlib.sha256(sharegpt_file.read_bytes()).hexdigest()
    assert got.ids.shape == (4, 24) and got.continuation.shape == (4, 8)
    assert len({tuple(row) for row in got.ids.tolist()}) == 4  # four different conversations
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    records = {record.id: record for record in read_sharegpt(sharegpt_file).conversations}
    replies = {
        tuple(tokenizer.encode(r.turns[1][1], add_special_tokens=False)[:8]): r.id
        for r in records.values()
        if len(r.turns) == 2
    }
    for prompt, continuation in zip(got.ids.tolist(), got.continuation.tolist(), strict=True):
        assert prompt[-len(header) :] == header  # the history up to the assistant's turn
        assert tuple(continuation) in replies  # the reply's own first tokens follow
    assert torch.equal(make("auto", chat_tokenizer_dir, dataset_path=str(sharegpt_file), seed=3).ids, got.ids)
    assert not torch.equal(make("auto", chat_tokenizer_dir, dataset_path=str(sharegpt_file), seed=4).ids, got.ids)


def test_too_few_long_enough_conversations_is_one_line(chat_tokenizer_dir, sharegpt_file):
    with pytest.raises(ConfigError, match=r"^prompt_len: only 8 of 10 ShareGPT conversations have a reply .* <= 8"):
        make("sharegpt", chat_tokenizer_dir, dataset_path=str(sharegpt_file), batch_size=9)


def test_text_windows_are_consecutive_tokens_of_the_file_chosen_by_the_seed(chat_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    text = tmp_path / "book.txt"
    text.write_text(" ".join(WORDS[(i * 7) % 99] for i in range(400)))
    ids = AutoTokenizer.from_pretrained(chat_tokenizer_dir).encode(text.read_text(), add_special_tokens=False)
    got = make("text", chat_tokenizer_dir, prompt_text=str(text), seed=1)
    windows = {tuple(ids[start : start + 32]) for start in range(0, len(ids) - 31, 32)}
    for prompt, continuation in zip(got.ids.tolist(), got.continuation.tolist(), strict=True):
        assert tuple(prompt + continuation) in windows  # a whole window: the prompt, then the text after it
    assert len({tuple(row) for row in got.ids.tolist()}) == 4
    assert got.sha256 == hashlib.sha256(text.read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=r"^prompt_text: .* 12 windows of prompt_len \+ gen_len = 32, fewer than"):
        make("text", chat_tokenizer_dir, prompt_text=str(text), batch_size=13)


def test_a_shared_prefix_is_the_first_prompts_and_each_keeps_its_own_text_before_the_cut(chat_tokenizer_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(" ".join(WORDS[(i * 7) % 99] for i in range(400)))
    plain = make("text", chat_tokenizer_dir, prompt_text=str(text), seed=1)
    shared = make("text", chat_tokenizer_dir, prompt_text=str(text), seed=1, prefix_len=10)
    assert torch.equal(shared.ids[:, :10], plain.ids[:1, :10].expand(4, 10))
    assert torch.equal(shared.ids[:, 10:], plain.ids[:, 10:])  # contiguous with the continuation
    assert torch.equal(shared.continuation, plain.continuation)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(prompt_source="words"), r"^prompt_source: unknown value 'words'; allowed: auto, random, sharegpt, text$"),
        (dict(prompt_source="sharegpt"), r"^prompt_source: sharegpt needs the model's tokenizer; allowed: weights="),
        (dict(prompt_source="text"), r"^prompt_text: prompt_source=text needs a file; allowed: prompt_text="),
        (dict(prompt_text="/nowhere.txt"), r"^prompt_text: read only with prompt_source=text, got prompt_source=auto"),
        (dict(dataset_path="/nowhere.json"), r"^dataset_path: read only with prompt_source=sharegpt"),
    ],
)
def test_bad_prompt_fields_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(model={"name": "tiny"}, **fields)


def test_a_missing_text_or_dataset_file_is_one_line(chat_tokenizer_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^prompt_text: '.*missing.txt' is not a file; allowed: a local text file$"):
        RunConfig(weights=str(chat_tokenizer_dir), prompt_source="text", prompt_text=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match=r"^dataset_path: '.*missing.json' is not a file; allowed: a local ShareGPT"):
        RunConfig(weights=str(chat_tokenizer_dir), dataset_path=str(tmp_path / "missing.json"))


def test_the_point_id_names_a_real_prompt_source_and_keeps_random_points_ids():
    assert (
        RunConfig(model={"name": "tiny"}, prompt_source="random").point_id()
        == RunConfig(model={"name": "tiny"}).point_id()
    )  # auto is random for dummy weights: the id every older row has


def test_real_text_teaches_the_accuracy_columns_and_gives_the_perplexity(llama_checkpoint):
    text = llama_checkpoint / "eval.txt"
    row = run_point(RunConfig(weights=str(llama_checkpoint), dtype="fp32", kv_dtype="int4", batch_size=2,
                              prompt_len=32, gen_len=16, prompt_source="text", prompt_text=str(text),
                              **FAST)).row  # fmt: skip
    assert row["status"] == "ok", row.get("error")
    assert row["prompt_source"] == "text" and row["prompt_text"] == str(text)
    assert row["prompt_sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert row["ppl_source"] == "text"
    assert 1.0 < row["ppl"] < 128 and row["ppl_delta"] != 0  # trained on this text: far better than uniform
    assert row["kl_mean"] > 0 and 0 < row["top1_agreement"] <= 1
    random_ids = run_point(RunConfig(weights=str(llama_checkpoint), dtype="fp32", kv_dtype="int4", batch_size=2,
                                     prompt_len=32, gen_len=16, prompt_source="random", **FAST)).row  # fmt: skip
    assert random_ids["prompt_source"] == "random" and random_ids.get("ppl") is None  # no text, no perplexity
    assert random_ids["kl_mean"] != row["kl_mean"]


@pytest.mark.slow
def test_smollm2_on_sharegpt_measures_its_int8_cache_on_real_replies():
    try:
        cfg = RunConfig(device="cpu", model={"name": "smollm2-135m"}, dtype="fp32", kv_dtype="int8", batch_size=1,
                        prompt_len=64, gen_len=8, **FAST)  # fmt: skip
    except ConfigError as exc:  # the wheels are make setup's; without them, the reason
        pytest.skip(str(exc))
    row = run_point(cfg).row
    assert row["status"] == "ok", row.get("error")
    assert row["prompt_source"] == "sharegpt" and row["ppl_source"] == "sharegpt"  # auto, for a real model
    assert row["prompt_sha256"] == read_sharegpt().sha256
    # A trained model on a chat reply: perplexity far below the 49,152-token vocabulary, int8 barely moves it
    assert 1.0 < row["ppl"] < 200 and abs(row["ppl_delta"]) < 0.05 * row["ppl"]
    assert row["top1_agreement"] >= 0.75 and row["kl_mean"] < 0.1
