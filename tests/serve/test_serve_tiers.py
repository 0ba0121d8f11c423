"""A serving prefix pool's host and disk tiers (issue #29 item 4): a block the pool evicts is copied into the tiers
before its id is reused, and a later request's lookup loads it back instead of computing it, counted by source;
the tokens stay those of a contiguous pool, and a corrupted block file is a miss, never wrong KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.config import DTYPES, Workload
from harness.errors import ConfigError
from harness.kv.block_file import FILE_SUFFIX
from harness.modeling.model import build_model
from harness.run.point import model_id
from harness.serve import run as app
from harness.serve.block_pool import hash_blocks
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.requests import Request
from harness.serve.rows import load_run, serve_run_dir
from harness.serve.scheduler import Scheduler, SchedulerConfig
from harness.serve.summary import summary_lines
from harness.serve.tier_store import ServeTiers, key_bytes
from harness.serve.tiered import TieredPrefixManager, TierMoves, TierOptions
from tests.serve.test_serve_multiturn import chat_checkpoint, chat_file, config, multiturn  # noqa: F401  (fixtures)

BLOCK = 4


class HostDict:
    """The tiers' calls on a dict: what the engine offloads is held, and a lookup finds it (the manager's side)."""

    def __init__(self):
        self.blocks: dict[object, int] = {}  # hash -> the pool block it was copied from
        self.looked_up: list[object] = []

    def source(self, block_hash):
        self.looked_up.append(block_hash)
        return "host" if block_hash in self.blocks else None


def turn(request_id: int, ids: list[int]) -> Request:
    return Request(request_id=request_id, arrival_s=0.0, prompt_len=len(ids), output_len=1,
                   block_hashes=hash_blocks(ids, BLOCK))  # fmt: skip


def step(scheduler: Scheduler, tiers: HostDict):
    """One iteration: the moves applied as the engine applies them, every scheduled token computed."""
    output = scheduler.schedule(0.0)
    for block, block_hash in output.tier_moves.offload:
        tiers.blocks[block_hash] = block
    for _, block_hash, source in output.tier_moves.load:
        assert source == "host" and block_hash in tiers.blocks, "a load of a block the tiers never got"
    return output, scheduler.update(output, 0.0)


def test_an_evicted_cached_block_goes_to_the_host_tier_and_a_later_request_loads_it_instead_of_computing():
    tiers = HostDict()
    manager = TieredPrefixManager(num_blocks=4, block_size=BLOCK, tiers=tiers)
    scheduler = Scheduler(SchedulerConfig(max_model_len=16, watermark=0.0), manager)
    history = list(range(10, 19))  # 9 tokens: two whole blocks cached, the third holds the tail
    scheduler.add_request(turn(0, history))
    output, _ = step(scheduler, tiers)
    assert output.tier_moves.offload == ()  # nothing evicted yet: the pool had free blocks never cached
    scheduler.add_request(turn(1, list(range(50, 63))))  # 13 tokens, 4 blocks: the whole pool, so both evicted
    output, _ = step(scheduler, tiers)
    first = hash_blocks(history, BLOCK)
    assert sorted(h for _, h in output.tier_moves.offload) == sorted(first)
    assert manager.pool.cached.keys().isdisjoint(first)  # gone from the device
    scheduler.add_request(turn(2, [*history, 70, 71, 72]))  # the next turn: the history, then more
    output, (record,) = step(scheduler, tiers)
    (entry,) = output.scheduled
    assert entry.num_computed_tokens == 8 and entry.num_new_tokens == 4  # two blocks loaded, not computed
    assert [(h, source) for _, h, source in output.tier_moves.load] == [(first[0], "host"), (first[1], "host")]
    assert [block for block, _, _ in output.tier_moves.load] == list(entry.blocks.get_block_ids()[:2])
    assert record.prefix_hit_tokens == 8
    assert manager.hit_tokens_by_source(2) == {"prefix_hit_tokens_host": 8, "prefix_hit_tokens_disk": 0}
    assert set(first) <= manager.pool.cached.keys()  # cached on the device again


def test_the_synthetic_streams_positional_prefix_blocks_never_reach_the_tiers():
    """Its ("prefix", index) keys name a position, not tokens: neither looked up nor offloaded when evicted."""
    tiers = HostDict()
    manager = TieredPrefixManager(num_blocks=3, block_size=BLOCK, tiers=tiers)
    first = Request(request_id=0, arrival_s=0.0, prompt_len=12, output_len=1, prefix_len=8)
    assert manager.cached_prefix_tokens(first, 12) == 0 and tiers.looked_up == []
    manager.allocate(first, 12)
    manager.free(0)
    manager.allocate(turn(1, list(range(50, 62))), 12)  # takes every block: the two prefix blocks evicted
    assert manager.pool.num_evictions == 2 and manager.take_tier_moves().offload == ()


# The end to end runs: the multiturn tests' chat checkpoint and conversations, in a pool of 12 blocks of 8 tokens,
# the longest turn's (96 tokens), one request at a time: every turn evicts the blocks of the turns before it.
SMALL = ["max_model_len=96", "kv_memory_gb=0.0000916", "max_num_seqs=1"]


def served(p: app.Plan) -> tuple[dict[int, list[int]], object]:
    """Every turn's output tokens, served closed-loop with the plan's tiers, as run() serves it."""
    cfg, cpu = p.cfg, torch.device("cpu")
    args = p.workload.model_args()
    model = build_model(args, weights=cfg.weights, dtype=DTYPES[cfg.dtype], device=cpu, seed=cfg.seed,
                        n_positions=cfg.max_model_len)  # fmt: skip
    cache, num_slots = build_cache(cfg.strategy, args, kv_dtype=p.kv_dtype, num_blocks=p.num_blocks,
                                   block_size=cfg.block_size, max_model_len=cfg.max_model_len, device=cpu)  # fmt: skip
    tiers = (
        ServeTiers.build(cfg.tier_options, cache=cache, model_id=model_id(cfg)) if cfg.tier_options.enabled else None
    )
    manager = app.kv_manager(cfg, p.num_blocks, tiers=tiers)
    first, first_ids = p.sessions.first_turns()
    result = serve(first, first_ids, scheduler=Scheduler(p.scheduler_config, manager),
                   engine=Engine(model, cache, num_slots=num_slots, tiers=tiers), next_turn=p.sessions.next_turn)  # fmt: skip
    return result.outputs, manager


@pytest.fixture(scope="module")
def contiguous_outputs(chat_checkpoint, chat_file):  # noqa: F811
    outputs, _ = served(app.plan(multiturn(chat_checkpoint, chat_file, "contiguous", *SMALL)))
    assert len(outputs) == 9
    return outputs


def by_source(manager: TieredPrefixManager, source: str) -> dict[int, int]:
    return {rid: counts[source] for rid, counts in manager.tier_hit_tokens.items()}


def test_the_host_tier_serves_later_turns_evicted_history_with_the_contiguous_pools_tokens(
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,
):
    outputs, manager = served(app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *SMALL, "cache.host_gb=1")))
    assert outputs == contiguous_outputs
    assert sum(by_source(manager, "host").values()) > 0 and sum(by_source(manager, "disk").values()) == 0


def test_without_tiers_the_small_pool_recomputes_the_history_the_host_tier_serves(chat_checkpoint, chat_file):  # noqa: F811
    """The control of the test above: the same run without a tier finds less of its history (on the device)."""

    def hits(*extra):
        p = app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *SMALL, *extra))
        _, manager = served(p)
        return sum(manager.prefix_hit_tokens(r.request_id) for r in p.requests), manager

    plain, plain_manager = hits()
    tiered, _ = hits("cache.host_gb=1")
    assert plain_manager.pool.num_evictions > 0 and tiered > plain


def test_the_disk_tier_alone_serves_evicted_history_and_a_run_records_hits_by_source(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,
):
    disk = tmp_path / "kv"
    p = app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *SMALL, "cache.host_gb=0", f"cache.disk_dir={disk}"))
    outputs, manager = served(p)
    assert outputs == contiguous_outputs
    assert sum(by_source(manager, "disk").values()) > 0 and sum(by_source(manager, "host").values()) == 0
    assert list(disk.rglob(f"*{FILE_SUFFIX}"))


def test_a_multiturn_run_with_a_host_tier_records_hits_by_source_and_the_tiers_figures(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
):
    p = app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *SMALL, "cache.host_gb=1"))
    row = app.run(p, run_dir=serve_run_dir(tmp_path, "mt"), sweep_id="s")
    requests, _, stored = load_run(serve_run_dir(tmp_path, "mt"))
    assert (requests["prefix_hit_tokens_host"] > 0).any() and (requests["prefix_hit_tokens_disk"] == 0).all()
    assert (
        requests["prefix_hit_tokens_host"] + requests["prefix_hit_tokens_device"] == requests["prefix_hit_tokens"]
    ).all()
    assert (requests.loc[requests["turn"] == 1, "prefix_hit_tokens"] == 0).all()
    assert stored["prefix_hit_rate_host"] > 0 and stored["prefix_hit_rate_disk"] == 0
    assert stored["prefix_hit_rate_device"] + stored["prefix_hit_rate_host"] == pytest.approx(row["prefix_hit_rate"])
    assert stored["tier_loaded_bytes"] > 0 and stored["tier_offloaded_bytes"] >= stored["tier_loaded_bytes"]
    assert stored["tier_d2h_gbps"] > 0 and stored["tier_h2d_gbps"] > 0 and stored["tier_disk_read_gbps"] is None
    assert '"cache": {"disk_dir": null, "disk_gb": 16.0, "host_gb": 1' in stored["config_json"]
    assert (stored["host_gb"], stored["disk_dir"], stored["disk_gb"]) == (1.0, None, None)
    (line,) = [line for line in summary_lines(row, Path()) if line.strip().startswith("tiers ")]
    assert f"host {100 * row['prefix_hit_rate_host']:.0f}%" in line and "MiB loaded (not recomputed)" in line


def test_a_run_without_tiers_has_null_tier_columns(tmp_path, chat_checkpoint, chat_file):  # noqa: F811
    p = app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *SMALL))
    app.run(p, run_dir=serve_run_dir(tmp_path, "mt"), sweep_id="s")
    requests, _, stored = load_run(serve_run_dir(tmp_path, "mt"))
    assert requests["prefix_hit_tokens_host"].isna().all() and stored["tier_loaded_bytes"] is None
    assert stored["host_gb"] is None and stored["disk_dir"] is None
    assert stored["prefix_hit_rate_device"] == pytest.approx(stored["prefix_hit_rate"])
    assert '"cache"' not in stored["config_json"]
    assert not any(line.strip().startswith("tiers ") for line in summary_lines(stored, Path()))


def test_a_corrupted_disk_block_file_is_a_miss_and_the_tokens_stay_the_contiguous_pools(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,
):
    disk = tmp_path / "kv"
    overrides = (*SMALL, "cache.host_gb=0", f"cache.disk_dir={disk}")
    served(app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *overrides)))  # fills the disk tier
    files = sorted(disk.rglob(f"*{FILE_SUFFIX}"))
    for path in files:  # every stored block: one payload byte flipped, so each read fails its checksum
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    outputs, manager = served(app.plan(multiturn(chat_checkpoint, chat_file, "prefix", *overrides)))
    assert outputs == contiguous_outputs
    assert len(manager.tiers.store.rejected) > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy=prefix", "cache.host_gb=-1"],
            r"^cache\.host_gb: must be 0 \(no host tier\) or a size in GB > 0, got -1$",
        ),
        (["strategy=prefix", "cache.disk_gb=0"], r"^cache\.disk_gb: must be a size in GB > 0, got 0$"),
        (["strategy=paged", "cache.host_gb=1"], r"^cache\.host_gb: only strategy=prefix keeps evicted blocks in tiers"),
        (["strategy=paged", "cache.disk_dir=/tmp/kv"], r"^cache\.disk_dir: only strategy=prefix keeps evicted blocks"),
    ],
)
def test_a_bad_tier_option_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        config("model=tiny", "kv_memory_gb=0.01", *overrides)
    assert "\n" not in str(refused.value)


def test_a_disk_dir_that_cannot_be_created_is_one_line_before_the_model_is_built(tmp_path):
    (tmp_path / "file").write_text("")
    cfg = config("model=tiny", "kv_memory_gb=0.01", "max_model_len=64", "num_prompts=2", "prompt_len=8",
                 "output_len=2", "strategy=prefix", f"cache.disk_dir={tmp_path / 'file' / 'kv'}")  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^cache\.disk_dir: .*/file/kv cannot be created \(.*\); allowed: a writable"
    ):
        app.plan(cfg)


def test_a_block_evicted_and_loaded_into_in_one_iteration_is_copied_out_before_it_is_overwritten():
    """The engine's order: the offload reads the evicted block's K/V first, then the load writes the same block."""
    args = Workload(model="tiny", cache={"name": "paged"}).model_args()
    cache, _ = build_cache("prefix", args, kv_dtype="fp32", num_blocks=4, block_size=BLOCK, max_model_len=16,
                           device=torch.device("cpu"))  # fmt: skip
    for block in range(4):  # every block's rows hold its own number
        cache.write_blocks([block], {name: torch.full_like(part, float(block)) for name, part in
                                     cache.read_blocks([block]).items()})  # fmt: skip
    tiers = ServeTiers.build(TierOptions(host_gb=1.0), cache=cache, model_id="m")
    tiers.apply(cache, TierMoves(offload=((2, 22),)))  # hash 22: block 2's K/V (2.0), now in the host tier
    cache.write_blocks([2], {name: torch.full_like(part, 5.0) for name, part in cache.read_blocks([2]).items()})
    assert tiers.source(22) == "host"  # the next iteration's lookup (the manager's, in its schedule)
    tiers.apply(cache, TierMoves(offload=((2, 33),), load=((2, 22, "host"),)))  # 2 evicted again, and loaded into
    assert all(torch.all(part == 2.0) for part in cache.read_blocks([2]).values())
    stored = tiers.store.host[key_bytes(33)]
    assert all(torch.all(part == 5.0) for part in stored.values())  # what block 2 held before the load
