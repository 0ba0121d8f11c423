"""dataset=sharegpt-multiturn (issue #29 item 4): chat sessions built from conversations through a chat template,
served closed-loop (a turn arrives its think time after the turn before it finished), where a prefix cache serves
a later turn's history from the blocks its earlier turns computed, with the very tokens a contiguous pool gives."""

from __future__ import annotations

import json
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.serve  # noqa: F401  (registers serve_config in Hydra's ConfigStore)
from harness.config import DTYPES
from harness.errors import ConfigError
from harness.modeling.model import build_model
from harness.serve import run as app
from harness.serve.block_pool import hash_blocks
from harness.serve.config import ServeConfig
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.kv_manager import make_kv_manager
from harness.serve.multiturn import THINK_STREAM, sample_sessions
from harness.serve.requests import Request, RequestSpec, arrival_times_s
from harness.serve.rows import load_run, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig
from harness.serve.sharegpt import Conversation
from harness.serve.summary import summary_lines

ROOT = Path(__file__).resolve().parents[2]
USER, ASSISTANT, END = 1, 2, 3  # the fake template's role and end-of-message ids


class ChatWordTokenizer:
    """One id per word (its number: "w17" -> 17), and a chat template of [role] content [end] per message, then
    [assistant] for the reply to come: the two calls the sessions use, as a transformers tokenizer answers them."""

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        assert tokenize and add_generation_prompt
        ids = []
        for message in conversation:
            ids += [USER if message["role"] == "user" else ASSISTANT, *self.encode(message["content"]), END]
        return {"input_ids": [*ids, ASSISTANT]}  # transformers 5's BatchEncoding is a dict of lists


def words(n: int, start: int) -> str:
    return " ".join(f"w{4 + (start + i) % 100}" for i in range(n))


def chat(index: int, *lengths: int) -> Conversation:
    """A conversation of alternating human and gpt turns of these word counts."""
    roles = ("human", "gpt")
    return Conversation(
        id=f"c{index}", turns=tuple((roles[i % 2], words(n, 10 * index + i)) for i, n in enumerate(lengths))
    )


def sessions_of(conversations, **knobs):
    defaults = dict(tokenizer=ChatWordTokenizer(), num_sessions=len(conversations), seed=0, max_model_len=512,
                    block_size=4)  # fmt: skip
    return sample_sessions(conversations, **(defaults | knobs))


def test_each_turns_prompt_is_its_history_through_the_template_and_extends_the_turn_before():
    (session,) = sessions_of([chat(0, 6, 5, 7, 8, 9, 4)]).sessions
    turns = chat(0, 6, 5, 7, 8, 9, 4).turns
    tokenizer = ChatWordTokenizer()
    history = []
    for k in range(3):
        history += [{"role": "user", "content": turns[2 * k][1]}]
        assert (
            list(session.prompt_ids[k])
            == tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)["input_ids"]
        )
        history += [{"role": "assistant", "content": turns[2 * k + 1][1]}]  # the dataset's reply, not the model's
    assert session.output_lens == (5, 8, 4)  # the replies' token counts
    for earlier, later in pairwise(session.prompt_ids):
        assert later[: len(earlier)] == earlier


def test_max_turns_caps_a_session_and_a_fixed_output_len_replaces_the_replies():
    sessions = sessions_of([chat(0, 6, 5, 7, 8, 9, 4), chat(1, 6, 5)], max_turns=2, output_len=3)
    assert [len(s.output_lens) for s in sessions.sessions] in ([2, 1], [1, 2])
    assert all(set(s.output_lens) == {3} for s in sessions.sessions)


def test_a_turn_over_max_model_len_ends_its_session_and_a_first_turn_over_it_drops_the_conversation():
    # first turns: 9-token prompts ([user] 6 words [end] [assistant]), 5 out; a second turn: 24 + 5 = 29 tokens
    conversations = [chat(0, 6, 5, 6, 5, 6, 5), chat(1, 30, 5), chat(2, 6), chat(3, 6, 2), chat(4, 6, 5)]
    sessions = sessions_of(conversations, num_sessions=2, max_model_len=26)  # both kept: every one looked at
    assert [len(s.output_lens) for s in sessions.sessions] == [1, 1]
    assert sessions.cut_turns["too_long"] == 2  # the turn over it and the one after it
    assert sessions.dropped == {"no_reply": 1, "prompt_too_short": 0, "output_too_short": 1, "too_long": 1}


def test_a_dataset_whose_every_session_is_filtered_out_is_one_line():
    with pytest.raises(ConfigError, match=r"^dataset: every one of 2 conversations is filtered out \(no_reply 1"):
        sessions_of([chat(0, 30, 5), chat(1, 6)], max_model_len=20)


def test_sessions_are_the_same_for_a_seed_and_differ_for_another():
    conversations = [chat(i, 5 + i, 6, 7, 4 + i) for i in range(8)]

    def ids(seed):
        return [s.prompt_ids for s in sessions_of(conversations, num_sessions=4, seed=seed).sessions]

    assert ids(0) == ids(0) and ids(0) != ids(1)


def test_sessions_start_at_the_synthetic_streams_arrivals_and_ids_go_by_session_and_turn():
    sessions = sessions_of([chat(i, 6, 5, 7, 4) for i in range(5)], qps=2.0, seed=3)
    spec = RequestSpec(num_prompts=5, qps=2.0, seed=3, prompt_len=1, output_len=1, max_model_len=512)
    assert [s.start_s for s in sessions.sessions] == pytest.approx(arrival_times_s(spec).tolist())
    requests, _ = sessions.all_turns()
    assert [r.request_id for r in requests] == list(range(10))
    assert sessions.request_columns(3) == {"session_id": 1, "turn": 2}


def test_think_times_are_exponential_with_the_mean_from_their_own_seeded_stream():
    sessions = sessions_of([chat(i, *[5] * 12) for i in range(150)], think_time_s=2.0, seed=5)
    gaps = np.concatenate([s.think_times_s for s in sessions.sessions])
    assert gaps.size == 150 * 5
    assert gaps.mean() == pytest.approx(2.0, rel=0.12)  # the mean's sd: 2 / sqrt(750) = 3.7%
    assert np.mean(gaps > 2.0) == pytest.approx(np.exp(-1), abs=0.05)  # an exponential's tail past its mean
    assert gaps.tolist() == pytest.approx(np.random.default_rng((5, THINK_STREAM)).exponential(2.0, 750).tolist())
    assert {g for s in sessions_of([chat(0, *[5] * 6)]).sessions for g in s.think_times_s} == {0.0}


def test_a_known_prompts_blocks_are_shared_by_content_and_only_after_an_equal_start():
    manager = make_kv_manager("prefix", num_blocks=32, block_size=4, max_model_len=64)
    first = Request(request_id=0, arrival_s=0.0, prompt_len=12, output_len=2,
                    block_hashes=hash_blocks(list(range(12)), 4))  # fmt: skip
    manager.allocate(first, 13)  # its prompt and one output: all three prompt blocks cached
    manager.free(0)  # finished: its blocks stay cached while the pool does not need them

    def hit_tokens(ids):
        request = Request(request_id=1, arrival_s=0.0, prompt_len=len(ids), output_len=2,
                          block_hashes=hash_blocks(ids, 4))  # fmt: skip
        return manager.cached_prefix_tokens(request, len(ids))

    assert hit_tokens([*range(12), 40, 41]) == 12  # a later turn: the history, then more
    assert hit_tokens([*range(6), 40, 41, 42, 43, 10, 11, 50]) == 4  # up to the first block that differs
    assert hit_tokens([40, *range(1, 12), 41]) == 0  # equal blocks after an unequal first one are not shared


class TokenlessEngine:
    """The engine's calls, without a model: the scheduler alone decides who runs and when each finishes."""

    def add_request(self, request, prompt_ids):
        assert len(prompt_ids) == request.prompt_len

    def execute(self, output):
        pass

    def finish(self, request_id):
        return []


def test_the_closed_loop_serves_every_turn_each_its_think_time_after_the_turn_before_it_finished():
    sessions = sessions_of([chat(i, 6, 5, 7, 4, 5, 6) for i in range(4)], think_time_s=0.01, qps=100.0)
    scheduler = Scheduler(SchedulerConfig(max_model_len=512), make_kv_manager("paged", num_blocks=512, block_size=4,
                                                                              max_model_len=512))  # fmt: skip
    first, first_ids = sessions.first_turns()
    result = serve(first, first_ids, scheduler=scheduler, engine=TokenlessEngine(), next_turn=sessions.next_turn)
    by_id = {int(record.request_id): record for record in result.records}
    assert sorted(by_id) == list(range(12))
    for session in sessions.sessions:
        ids = range(session.first_request_id, session.first_request_id + 3)
        assert by_id[ids[0]].arrival_s == pytest.approx(session.start_s)
        for think_s, before, after in zip(session.think_times_s, ids[:-1], ids[1:], strict=True):
            assert by_id[after].arrival_s == pytest.approx(by_id[before].finished_s + think_s)
            assert by_id[after].first_scheduled_s >= by_id[after].arrival_s


# The end to end runs: the conftest's trained Llama, its word tokenizer given a chat template in its own words.
TEMPLATE = ("{% for m in messages %}{{ 'w1 ' if m['role'] == 'user' else 'w2 ' }}{{ m['content'] }} w3 "
            "{% endfor %}{% if add_generation_prompt %}w2{% endif %}")  # fmt: skip
TINY = ["model=tiny", "max_model_len=256", "block_size=8", "dtype=fp32", "kv_memory_gb=0.002", "qps=inf"]


@pytest.fixture(scope="module")
def chat_checkpoint(llama_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat-ckpt") / "llama"
    shutil.copytree(llama_checkpoint, folder)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human" if t % 2 == 0 else "gpt", "value": words(9 + i + t, 7 * i + t)}
                                          for t in range(6)]}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("chats") / "chats.json"
    path.write_text(json.dumps(records))
    return path


def config(*overrides: str) -> ServeConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="serve", overrides=list(overrides)))


def multiturn(checkpoint, path, strategy: str, *extra: str) -> ServeConfig:
    return config(*TINY, "dataset=sharegpt-multiturn", f"dataset_path={path}", f"weights={checkpoint}",
                  "num_prompts=3", f"strategy={strategy}", "run_id=mt", *extra)  # fmt: skip


def served_outputs(p: app.Plan) -> dict[int, list[int]]:
    """Every turn's output tokens, served closed-loop as run() serves the plan."""
    cfg = p.cfg
    args = p.workload.model_args()
    model = build_model(args, weights=cfg.weights, dtype=DTYPES[cfg.dtype], device=torch.device("cpu"),
                        seed=cfg.seed, n_positions=cfg.max_model_len)  # fmt: skip
    cache, num_slots = build_cache(cfg.strategy, args, kv_dtype=p.kv_dtype, num_blocks=p.num_blocks,
                                   block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                   device=torch.device("cpu"))  # fmt: skip
    engine = Engine(model, cache, num_slots=num_slots)
    first, first_ids = p.sessions.first_turns()
    result = serve(first, first_ids, scheduler=Scheduler(p.scheduler_config, app.kv_manager(cfg, p.num_blocks)),
                   engine=engine, next_turn=p.sessions.next_turn)  # fmt: skip
    return result.outputs


def test_a_prefix_pool_serves_later_turns_history_from_cache_with_the_contiguous_pools_tokens(
    chat_checkpoint, chat_file
):
    contiguous = app.plan(multiturn(chat_checkpoint, chat_file, "contiguous"))
    prefix = app.plan(multiturn(chat_checkpoint, chat_file, "prefix"))
    assert prefix.prompt_ids == contiguous.prompt_ids  # the same prompt ids whatever the strategy
    expected = served_outputs(contiguous)
    assert len(expected) == 9 and served_outputs(prefix) == expected


def test_a_multiturn_run_records_sessions_turns_prefix_hits_and_ttft_by_turn(tmp_path, chat_checkpoint, chat_file):
    p = app.plan(multiturn(chat_checkpoint, chat_file, "prefix"))
    row = app.run(p, run_dir=serve_run_dir(tmp_path, "mt"), sweep_id="s")
    assert row["completed"] == 9 and row["prefix_hit_rate"] > 0
    requests, _, stored = load_run(serve_run_dir(tmp_path, "mt"))
    lengths = {r.request_id: r.prompt_len for r in p.requests}
    for request in requests.itertuples():
        if request.turn == 1:
            assert request.prefix_hit_tokens == 0
        else:  # every whole block of the turn before's prompt, kept cached between the turns
            assert request.prefix_hit_tokens == lengths[int(request.request_id) - 1] // 8 * 8 > 0
    assert sorted(zip(requests["session_id"], requests["turn"], strict=True)) == [
        (s, t) for s in range(3) for t in (1, 2, 3)
    ]
    by_turn = json.loads(stored["ttft_ms_by_turn"])
    assert list(by_turn) == ["1", "2", "3"] and all(figures["count"] == 3 for figures in by_turn.values())
    assert stored["dataset"] == "sharegpt-multiturn" and stored["dataset_cut_turns_too_long"] == 0
    assert json.loads(stored["config_json"])["max_turns"] is None
    assert any(
        line.strip().startswith("by turn      TTFT p50/p99 per turn number 1: ") for line in summary_lines(row, Path())
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_turns=0"], r"^max_turns: must be an integer >= 1, or null \(every turn\), got 0$"),
        (["think_time_s=-1"], r"^think_time_s: must be a finite number of seconds >= 0 \(the mean\), got -1"),
        (["dataset=sharegpt", "max_turns=2"], "^max_turns: only dataset=sharegpt-multiturn takes it; allowed: null"),
    ],
)
def test_a_session_knob_out_of_range_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        config(*TINY, "dataset=sharegpt-multiturn", *overrides)
    assert "\n" not in str(refused.value)


def test_a_tokenizer_without_a_chat_template_is_one_line_before_the_model_is_built(llama_checkpoint, chat_file):
    with pytest.raises(ConfigError, match="^weights: the tokenizer has no chat template .*allowed: a checkpoint"):
        app.plan(multiturn(llama_checkpoint, chat_file, "prefix"))
