"""Overlapped tier loads (issue #30 item 3, tier_overlap): a request's disk blocks are read by a loader thread while
it waits, checksums checked there, and an iteration's loads go into the pool layer by layer while the forward runs;
the tokens stay those of a contiguous pool with and without overlap, and a corrupted block file is still a miss.
How much faster the first token is belongs to `make bench-tiers-overlap`; here the overlap path is asserted."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.config import DTYPES, Workload
from harness.errors import ConfigError
from harness.kv.block_file import FILE_SUFFIX
from harness.modeling.model import build_model
from harness.run.point import model_id
from harness.serve import run as app
from harness.serve.engine import Engine, build_cache, serve
from harness.serve.rows import load_run, serve_run_dir
from harness.serve.scheduler import Scheduler
from harness.serve.tier_loader import URGENT, LayerLoads, Loader, LoadTimes
from harness.serve.tier_store import ServeTiers
from harness.serve.tiered import overlaps
from tests.serve.test_serve_multiturn import chat_checkpoint, chat_file, config, multiturn  # noqa: F401  (fixtures)
from tests.serve.test_serve_tiers import SMALL, contiguous_outputs  # noqa: F401  (a fixture)


def served(p: app.Plan, *, overlap: bool) -> tuple[dict[int, list[int]], ServeTiers]:
    """Every turn's output tokens, served closed-loop with the plan's tiers, overlapped or not."""
    cfg, cpu = p.cfg, torch.device("cpu")
    args = p.workload.model_args()
    model = build_model(args, weights=cfg.weights, dtype=DTYPES[cfg.dtype], device=cpu, seed=cfg.seed,
                        n_positions=cfg.max_model_len)  # fmt: skip
    cache, num_slots = build_cache(cfg.strategy, args, kv_dtype=p.kv_dtype, num_blocks=p.num_blocks,
                                   block_size=cfg.block_size, max_model_len=cfg.max_model_len, device=cpu)  # fmt: skip
    tiers = ServeTiers.build(cfg.tier_options, cache=cache, model_id=model_id(cfg), overlap=overlap)
    manager = app.kv_manager(cfg, p.num_blocks, tiers=tiers)
    first, first_ids = p.sessions.first_turns()
    result = serve(first, first_ids, scheduler=Scheduler(p.scheduler_config, manager),
                   engine=Engine(model, cache, num_slots=num_slots, tiers=tiers), next_turn=p.sessions.next_turn)  # fmt: skip
    return result.outputs, tiers


def disk_plan(checkpoint, path, disk) -> app.Plan:
    return app.plan(multiturn(checkpoint, path, "prefix", *SMALL, "cache.host_gb=0", f"cache.disk_dir={disk}"))


def test_overlapped_disk_loads_are_prefetched_and_layered_with_the_contiguous_pools_tokens(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,  # noqa: F811
):
    outputs, tiers = served(disk_plan(chat_checkpoint, chat_file, tmp_path / "kv"), overlap=True)
    assert outputs == contiguous_outputs
    assert tiers.prefetch_used > 0, "no lookup found its disk block read ahead"
    assert tiers.layered_loads > 0, "no iteration loaded layer by layer"
    times = tiers.load_times
    assert times.busy_s > 0 and times.hidden_s > 0
    assert tiers.run_columns()["tier_load_hidden_share"] == pytest.approx(times.hidden_s / times.busy_s)


def test_synchronous_disk_loads_give_the_same_tokens_and_hide_nothing(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,  # noqa: F811
):
    outputs, tiers = served(disk_plan(chat_checkpoint, chat_file, tmp_path / "kv"), overlap=False)
    assert outputs == contiguous_outputs
    assert tiers.prefetch_used == 0 and tiers.layered_loads == 0 and not tiers.prefetched
    columns = tiers.run_columns()
    assert columns["tier_overlap"] is False and columns["tier_load_s"] > 0
    assert columns["tier_load_hidden_s"] == 0 and columns["tier_load_hidden_share"] == 0


def test_a_corrupted_disk_block_read_ahead_is_still_a_miss_and_the_tokens_stay_the_contiguous_pools(
    tmp_path,
    chat_checkpoint,  # noqa: F811
    chat_file,  # noqa: F811
    contiguous_outputs,  # noqa: F811
):
    disk = tmp_path / "kv"
    served(disk_plan(chat_checkpoint, chat_file, disk), overlap=False)  # fills the disk tier
    files = sorted(disk.rglob(f"*{FILE_SUFFIX}"))
    assert files
    for path in files:  # every stored block: one payload byte flipped, so each read fails its checksum
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    outputs, tiers = served(disk_plan(chat_checkpoint, chat_file, disk), overlap=True)
    assert outputs == contiguous_outputs
    assert len(tiers.store.rejected) > 0


def test_a_layer_waits_only_for_its_own_blocks_and_the_layers_land_as_write_blocks_puts_them():
    """The loader copies layer 0 first; a forward at layer 0 does not wait for layer 1, and every layer ends equal to
    the synchronous write. The loader is held busy by a gate, so the order is seen without a clock."""
    args = Workload(model="tiny", cache={"name": "paged"}).model_args()
    cpu = torch.device("cpu")
    cache, _ = build_cache("prefix", args, kv_dtype="fp32", num_blocks=4, block_size=4, max_model_len=16, device=cpu)
    expected, _ = build_cache("prefix", args, kv_dtype="fp32", num_blocks=4, block_size=4, max_model_len=16, device=cpu)
    generator = torch.Generator().manual_seed(0)
    staged = [{name: torch.randn(part.shape, generator=generator) for name, part in cache.read_blocks([b]).items()}
              for b in (1, 3)]  # fmt: skip
    expected.write_blocks([1, 3], {name: torch.cat([s[name] for s in staged], dim=1) for name in staged[0]})
    times = LoadTimes()
    loader = Loader(times)
    gate, held = threading.Event(), threading.Event()
    loader.submit(URGENT, lambda: (held.set(), gate.wait()))
    held.wait()
    loads = LayerLoads(cache, [1, 3], staged, times)
    loads.start(loader)
    assert not any(event.is_set() for event in loads.ready)  # nothing in while the loader is busy
    gate.set()
    loads.wait(0)
    assert torch.equal(cache.rows["k"][0], expected.rows["k"][0])
    loads.finish()
    assert all(torch.equal(cache.rows[name], expected.rows[name]) for name in ("k", "v"))
    assert times.busy_s > 0 and loads.n_bytes == sum(t.numel() * 4 for s in staged for t in s.values())


def test_a_run_records_tier_overlap_and_the_load_times(tmp_path, chat_checkpoint, chat_file):  # noqa: F811
    p = disk_plan(chat_checkpoint, chat_file, tmp_path / "kv")
    assert p.cfg.tier_overlap is None and overlaps(p.cfg.tier_overlap, p.cfg.tier_options)  # null: on with tiers
    app.run(p, run_dir=serve_run_dir(tmp_path, "mt"), sweep_id="s")
    _, _, stored = load_run(serve_run_dir(tmp_path, "mt"))
    assert stored["tier_overlap"] is True or stored["tier_overlap"] == 1
    assert stored["tier_load_s"] > 0 and 0 < stored["tier_load_hidden_share"] <= 1
    assert stored["tier_load_hidden_s"] == pytest.approx(stored["tier_load_s"] * stored["tier_load_hidden_share"])
    assert '"tier_overlap": null' in stored["config_json"]


def test_a_run_without_tiers_leaves_tier_overlap_out_of_its_config(tmp_path):
    cfg = config("model=tiny", "kv_memory_gb=0.01", "strategy=prefix")
    assert "tier_overlap" not in cfg.config_dict() and not overlaps(cfg.tier_overlap, cfg.tier_options)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=paged", "tier_overlap=true"], r"^tier_overlap: true needs tiers to load from \(strategy=prefix"),
        (["strategy=prefix", "tier_overlap=true"], r"^tier_overlap: true needs tiers .*allowed: null or false"),
    ],
)
def test_tier_overlap_true_without_tiers_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        config("model=tiny", "kv_memory_gb=0.01", *overrides)
    assert "\n" not in str(refused.value)


def test_tier_overlap_false_without_tiers_and_the_default_are_accepted():
    for extra in ([], ["tier_overlap=false"]):
        config("model=tiny", "kv_memory_gb=0.01", "strategy=paged", *extra)
