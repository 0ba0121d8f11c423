"""harness/serve/peer.py: transformers' continuous batching replays our request stream on a real checkpoint, each
request gets exactly its output_len greedy tokens, those of the prompt decoded alone, with its times in order; bad
input and a transformers without the engine fail with one line before any model loads."""

from __future__ import annotations

import sys

import pytest
import torch

from harness.errors import ConfigError
from harness.modeling.model_args import ModelArgs
from harness.run import versus
from harness.serve.peer import run_transformers_cb
from harness.serve.requests import Request, prompt_token_ids
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens

transformers = pytest.importorskip("transformers")

TINY = ModelArgs.from_name("tiny")
VOCAB_SIZE = TINY.vocab_size
# (arrival_s, prompt_len, output_len): three at once, then three later; prompts from 3 to 90 tokens, so that with
# max_num_batched_tokens=32 the long ones are prefilled in chunks beside the others' decode steps.
MIXED = [(0.0, 5, 8), (0.0, 40, 12), (0.0, 17, 20), (0.05, 90, 6), (0.1, 3, 30), (0.15, 60, 16)]
ROOMY = dict(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, dtype="fp32")
# The same requests all at once into 14 blocks x 8 = 112 tokens (the longest needs 96): the engine runs out of blocks
# and preempts. All at once, its schedule does not depend on the clock, so neither does the preemption.
AT_ONCE = [(0.0, prompt_len, output_len) for _, prompt_len, output_len in MIXED]
TIGHT = dict(ROOMY, num_blocks=14)


def stream(shape: list[tuple[float, int, int]]) -> list[Request]:
    return [
        Request(request_id=i, arrival_s=arrival_s, prompt_len=prompt_len, output_len=output_len)
        for i, (arrival_s, prompt_len, output_len) in enumerate(shape)
    ]


def solo_greedy(model, prompt: list[int], output_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' generate() on the prompt alone: ([1, output_len] ids, [1, output_len, V] logits behind them)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # its default masks every id equal to pad_token_id
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, len(prompt) :], torch.stack(out.logits, dim=1).float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """transformers' LlamaForCausalLM at the tiny preset's shapes, its seeded init, saved with save_pretrained."""
    return versus.save_checkpoint(TINY, tmp_path_factory.mktemp("hf-tiny"), seed=0)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return versus.load_hf_model(checkpoint, dtype="fp32", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def mixed(checkpoint):
    requests = stream(MIXED)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    return requests, token_ids, run_transformers_cb(checkpoint, requests, token_ids=token_ids, **ROOMY)


def assert_equal_to_solo_decoding(hf_model, requests, token_ids, run) -> None:
    for request, prompt, output in zip(requests, token_ids, run.output_token_ids, strict=True):
        expected, logits = solo_greedy(hf_model, prompt, request.output_len)
        assert_same_greedy_tokens(torch.tensor([output]), expected, logits, tol=LOGIT_TOL["fp32"])


def test_every_request_gets_exactly_its_output_len_tokens(mixed):
    requests, _, run = mixed
    assert [len(tokens) for tokens in run.output_token_ids] == [request.output_len for request in requests]
    assert [record.output_len for record in run.records] == [request.output_len for request in requests]
    assert [record.request_id for record in run.records] == [str(request.request_id) for request in requests]


def test_mixed_lengths_and_chunked_prefill_give_each_prompt_its_solo_greedy_tokens(hf_model, mixed):
    assert_equal_to_solo_decoding(hf_model, *mixed)


def test_each_record_is_in_time_order_from_its_arrival(mixed):
    requests, _, run = mixed
    for request, record in zip(requests, run.records, strict=True):
        assert record.arrival_s == request.arrival_s
        times = [record.arrival_s, record.first_scheduled_s, *record.token_times_s, record.finished_s]
        assert times == sorted(times), (request.request_id, times)
    assert run.duration_s == max(record.finished_s for record in run.records)  # the first arrival is at 0
    assert run.max_submit_lag_s >= 0


def test_the_run_reports_the_pool_it_was_given(mixed):
    _, _, run = mixed
    assert (run.num_blocks, run.block_size) == (ROOMY["num_blocks"], ROOMY["block_size"])
    assert (run.max_num_seqs, run.max_num_batched_tokens) == (ROOMY["max_num_seqs"], ROOMY["max_num_batched_tokens"])
    assert (run.scheduler, run.attn_implementation) == ("fifo", "sdpa")


def test_a_tight_pool_preempts_and_every_request_still_gets_its_solo_tokens(hf_model, checkpoint):
    requests = stream(AT_ONCE)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    run = run_transformers_cb(checkpoint, requests, token_ids=token_ids, **TIGHT)
    assert sum(record.preemptions for record in run.records) > 0
    assert [len(tokens) for tokens in run.output_token_ids] == [request.output_len for request in requests]
    assert_equal_to_solo_decoding(hf_model, requests, token_ids, run)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(scheduler="lifo"), "scheduler"),
        (dict(dtype="fp64"), "dtype"),
        (dict(block_size=2), "block_size"),
        (dict(num_blocks=4), "num_blocks"),  # 32 tokens, below the 90 + 6 of request 3
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(attn_implementation="flex_attention"), "attn_implementation"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(tmp_path, change, field):
    requests = stream(MIXED)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    with pytest.raises(ConfigError, match=f"^{field}: ") as caught:
        run_transformers_cb(tmp_path, requests, token_ids=token_ids, **(ROOMY | change))
    assert "\n" not in str(caught.value)


def test_prompts_that_do_not_match_the_requests_are_refused(tmp_path):
    requests = stream(MIXED)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    with pytest.raises(ConfigError, match="^token_ids: 5 prompts for 6 requests"):
        run_transformers_cb(tmp_path, requests, token_ids=token_ids[:5], **ROOMY)
    with pytest.raises(ConfigError, match="^token_ids: request 2 has 16 ids, its prompt_len is 17"):
        run_transformers_cb(tmp_path, requests, token_ids=[*token_ids[:2], token_ids[2][:-1], *token_ids[3:]], **ROOMY)


def test_repeated_request_ids_are_refused(tmp_path):
    requests = stream(MIXED)
    requests[4] = Request(request_id=1, arrival_s=0.1, prompt_len=3, output_len=30)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    with pytest.raises(ConfigError, match="^requests: request_id must be unique; repeated: 1$"):
        run_transformers_cb(tmp_path, requests, token_ids=token_ids, **ROOMY)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    requests = stream(MIXED)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    with pytest.raises(ConfigError, match="^model_dir: .* has no config.json"):
        run_transformers_cb(tmp_path, requests, token_ids=token_ids, **ROOMY)


def test_a_transformers_without_continuous_batching_is_a_config_error(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.generation.continuous_batching", None)  # its import now fails
    requests = stream(MIXED)
    token_ids = prompt_token_ids(requests, vocab_size=VOCAB_SIZE, seed=0)
    with pytest.raises(ConfigError, match="^engine: transformers-cb needs transformers >= 5 with continuous batching"):
        run_transformers_cb(checkpoint, requests, token_ids=token_ids, **ROOMY)
