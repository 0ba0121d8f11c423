"""KV tiers below device memory: a prefix written through to host and disk is found again, by a later cache (a new
process) or after the device copy is gone, with the same tokens as computing it; a foreign or corrupt block file is
refused with a warning naming it, and the prefix is recomputed."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from harness import kv
from harness.config import RunConfig
from harness.kv import block_file, tiers
from harness.kv.base import CacheSpec
from harness.kv.prefix import block_hashes
from harness.measure.timing import StepTimer
from harness.modeling.decode import generate
from harness.run.point import run_point
from tests.greedy import LOGIT_TOL, assert_same_greedy_tokens, greedy_with_logits

CPU = torch.device("cpu")
BATCH, PROMPT_LEN, PREFIX_LEN, GEN_LEN, BLOCK = 2, 45, 32, 6, 8


def spec_for(args, *, kv_dtype="fp32", model_id="tiny-seed-0", **quant) -> CacheSpec:
    return CacheSpec.for_model(
        args,
        batch_size=BATCH,
        max_tokens=PROMPT_LEN + GEN_LEN,
        kv_dtype=kv_dtype,
        device=CPU,
        prefix_len=PREFIX_LEN,
        model_id=model_id,
        **quant,
    )


def prompt_for(args, *, seed: int = 1) -> torch.Tensor:
    prompt = torch.randint(args.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    prompt[:, :PREFIX_LEN] = prompt[0, :PREFIX_LEN].clone()
    return prompt


def generate_with(model, cache, prompt) -> torch.Tensor:
    tokens, _ = generate(model, cache, prompt, GEN_LEN, StepTimer(CPU, n_marks=GEN_LEN), prompt_ids=prompt.tolist())
    return tokens


def tiered(args, tmp_path, *, host_gb=0.0, disk=True, **spec_kwargs):
    options = {"block_size": BLOCK, "host_gb": host_gb, "disk_dir": str(tmp_path / "kv") if disk else None}
    return kv.build("prefix", spec_for(args, **spec_kwargs), options)


def block_files(tmp_path) -> list:
    return sorted((tmp_path / "kv").rglob(f"*{block_file.FILE_SUFFIX}"))


QUANT = {"int4": {"kv_group_size": 8, "kv_residual": 0}}  # tiny's head_dim is 16; prefix needs kv_residual=0


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "int8", "fp8_e4m3", "int4"])
def test_a_second_cache_loads_the_prefix_from_disk_and_generates_the_same_tokens(
    tiny_model, tiny_args, tmp_path, kv_dtype
):
    prompt = prompt_for(tiny_args)
    quant = QUANT.get(kv_dtype, {})
    device_only = kv.build("prefix", spec_for(tiny_args, kv_dtype=kv_dtype, **quant), {"block_size": BLOCK})
    expected = generate_with(tiny_model, device_only, prompt)

    first = tiered(tiny_args, tmp_path, kv_dtype=kv_dtype, **quant)
    assert torch.equal(generate_with(tiny_model, first, prompt), expected)
    assert first.prefix_sources == ["computed"]
    assert len(block_files(tmp_path)) == PREFIX_LEN // BLOCK  # written through, one file per block

    second = tiered(tiny_args, tmp_path, kv_dtype=kv_dtype, **quant)  # what a later process builds
    assert torch.equal(generate_with(tiny_model, second, prompt), expected)
    assert second.prefix_sources == ["disk"]
    reads = [t for t in second.store.transfers if t.direction == "read"]
    assert len(reads) == PREFIX_LEN // BLOCK and sum(t.n_bytes for t in reads) == second.prefix_bytes()


def test_the_loaded_prefix_is_not_computed_again(tiny_model, tiny_args, tmp_path):
    prompt = prompt_for(tiny_args)
    generate_with(tiny_model, tiered(tiny_args, tmp_path), prompt)
    seen = []

    def counting(tokens, **kwargs):
        seen.append((tokens.shape[1], kwargs["start_pos"]))
        return tiny_model(tokens, **kwargs)

    counting.rope_cos = tiny_model.rope_cos
    second = tiered(tiny_args, tmp_path)
    generate_with(counting, second, prompt)
    assert seen[0] == (PROMPT_LEN - PREFIX_LEN, PREFIX_LEN)  # the prefill ran the suffix alone, after the prefix


def test_host_tier_serves_the_prefix_once_the_device_copy_is_forgotten(tiny_model, tiny_args, tmp_path):
    prompt = prompt_for(tiny_args)
    cache = tiered(tiny_args, tmp_path, host_gb=1.0)
    expected = generate_with(tiny_model, cache, prompt)
    cache.release()
    cache.forget_prefix()
    assert torch.equal(generate_with(tiny_model, cache, prompt), expected)
    cache.release()
    cache.forget_prefix()
    cache.store.drop_host()
    assert torch.equal(generate_with(tiny_model, cache, prompt), expected)
    cache.release()
    assert cache.prefix_sources == ["computed", "host", "disk"]
    cache.forget_prefix()
    with cache.store.bypassed():
        assert torch.equal(generate_with(tiny_model, cache, prompt), expected)
    assert cache.prefix_sources[-1] == "computed"


def test_a_corrupt_block_file_is_a_miss_with_a_warning_naming_it(tiny_model, tiny_args, tmp_path, caplog):
    prompt = prompt_for(tiny_args)
    generate_with(tiny_model, tiered(tiny_args, tmp_path), prompt)  # computes and writes the four blocks
    # The recomputed blocks come from a forward over the last 16 prefix tokens, not all 32: another GEMM shape, so
    # the tokens are held to the reference's up to a near-tie (tests/greedy.py), not bit for bit.
    device_only = kv.build("prefix", spec_for(tiny_args), {"block_size": BLOCK})
    reference, logits = greedy_with_logits(tiny_model, device_only, prompt, GEN_LEN)

    def same_tokens(tokens: torch.Tensor) -> None:
        assert_same_greedy_tokens(tokens, reference, logits, tol=LOGIT_TOL["fp32"])

    keys = block_hashes(prompt[0, :PREFIX_LEN].numpy(), BLOCK)
    second = tiered(tiny_args, tmp_path)
    bad = second.store.path(keys[2])
    data = bytearray(bad.read_bytes())
    data[block_file.ALIGN] ^= 0xFF  # the first byte of the first part (the header fills the first ALIGN bytes)
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="harness.kv.tiers"):
        same_tokens(generate_with(tiny_model, second, prompt))
    assert any(str(bad) in record.getMessage() for record in caplog.records)
    assert second.prefix_sources == ["disk+computed"]  # blocks 0 and 1 loaded, 2 and 3 recomputed
    assert len(second.store.rejected) == 1
    third = tiered(tiny_args, tmp_path)  # the refused file was written again, right
    same_tokens(generate_with(tiny_model, third, prompt))
    assert third.prefix_sources == ["disk"] and not third.store.rejected


def test_a_foreign_block_file_is_refused_by_its_identity(tiny_model, tiny_args, tmp_path, caplog):
    prompt = prompt_for(tiny_args)
    theirs = tiered(tiny_args, tmp_path, model_id="other-weights")
    generate_with(tiny_model, theirs, prompt)
    ours = tiered(tiny_args, tmp_path)
    assert ours.store.root != theirs.store.root  # two models never share a folder
    keys = block_hashes(prompt[0, :PREFIX_LEN].numpy(), BLOCK)
    ours.store.path(keys[0]).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(theirs.store.path(keys[0]), ours.store.path(keys[0]))  # their file where ours would be
    expected = kv.build("prefix", spec_for(tiny_args), {"block_size": BLOCK})
    with caplog.at_level(logging.WARNING, logger="harness.kv.tiers"):
        assert torch.equal(generate_with(tiny_model, ours, prompt), generate_with(tiny_model, expected, prompt))
    assert ours.prefix_sources == ["computed"]
    message = ours.store.rejected[0]
    assert "model_id" in message and str(ours.store.path(keys[0])) in message


def test_the_host_tier_keeps_the_most_recently_used_blocks_within_its_capacity(tiny_args, tmp_path):
    cache = tiered(tiny_args, tmp_path, disk=False, host_gb=1.0)
    store = cache.store
    parts = cache.read_blocks([0, 1, 2])
    per_block = tiers.parts_bytes(parts) // 3
    store.host_bytes = 2 * per_block  # room for two blocks
    store.save([b"a", b"b", b"c"], parts)
    assert list(store.host) == [b"b", b"c"] and store.host_used == 2 * per_block
    loaded, n, source = store.load([b"b"])
    assert n == 1 and source == tiers.HOST and torch.equal(loaded["k"], parts["k"][:, 1:2])
    store.save([b"d"], cache.read_blocks([3]))
    assert list(store.host) == [b"b", b"d"]  # c was the least recently used


def test_the_disk_tier_deletes_the_least_recently_used_files_beyond_its_capacity(tiny_args, tmp_path):
    cache = tiered(tiny_args, tmp_path)
    store = cache.store
    parts = cache.read_blocks([0, 1, 2])
    store.save([b"a", b"b", b"c"], parts)
    size = store.path(b"a").stat().st_size
    store.disk_bytes = 2 * size
    store.save([b"d"], cache.read_blocks([3]))
    assert [store._on_disk(key) for key in (b"a", b"b", b"c", b"d")] == [False, False, True, True]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("host_gb", -1.0, r"^cache\.host_gb: must be 0 \(no host tier\) or a positive size in GB, got -1\.0$"),
        ("disk_gb", 0.0, r"^cache\.disk_gb: must be a positive size in GB, got 0\.0$"),
        ("disk_dir", " ", r"^cache\.disk_dir: must be a directory path, or null for no disk tier$"),
    ],
)
def test_tier_options_are_validated_by_name(option, value, message):
    with pytest.raises(ValueError, match=message):
        kv.parse_options("prefix", {option: value})


def point(tmp_path, **overrides) -> RunConfig:
    fields = dict(
        model={"name": "tiny"},
        dtype="fp32",
        cache={"name": "prefix", "block_size": BLOCK, "host_gb": 1.0, "disk_dir": str(tmp_path / "kv")},
        batch_size=BATCH,
        prompt_len=PROMPT_LEN,
        prefix_len=PREFIX_LEN,
        gen_len=4,
        warmup=1,
        min_repeats=2,
        max_repeats=2,
        isolate=False,
        roofline=False,
        results_dir=str(tmp_path / "results"),
    )
    return RunConfig(**(fields | overrides))


def test_two_runs_of_a_prefix_point_the_second_loads_from_disk_with_equal_outputs(tmp_path):
    first = run_point(point(tmp_path)).row
    second = run_point(point(tmp_path)).row
    assert first["status"] == second["status"] == "ok"
    assert (first["prefix_source"], second["prefix_source"]) == ("computed", "disk")
    assert first["output_digest"] == second["output_digest"]
    for row in (first, second):
        for column in ("ttft_ms", "ttft_host_ms", "ttft_disk_ms", "ttft_miss_ms", "prefix_disk_read_gbps"):
            assert row[column] > 0, column
        assert row["prefix_bytes_stored"] == PREFIX_LEN * 2 * 2 * 2 * 16 * 4  # tokens x K|V x L x H x D x fp32
        assert row["prefix_rejected_blocks"] == 0
        assert (row["host_gb"], row["disk_gb"]) == (1.0, 16.0)
