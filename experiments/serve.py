"""Serve a request stream on the real model, continuous batching over a KV pool; one Hydra job per run.

    python -m experiments.serve experiment=serve-quick            # the small model on the CPU, a few dozen requests
    python -m experiments.serve strategy=contiguous kv_memory_gb=0.25 num_prompts=64 qps=4
    python -m experiments.serve -m experiment=serve-qps          # qps x strategy: the saturation sweep and its knee
    python -m experiments.serve trace=my_trace.jsonl               # arrival_s, prompt_len, output_len per line
    python -m experiments.serve dataset=sharegpt weights=CKPT_DIR   # ShareGPT V3 prompts, the checkpoint's tokenizer
    python -m experiments.serve model=smollm2-135m dataset=sharegpt-multiturn strategy=prefix kv_memory_gb=0.2  # chats

This file is the Hydra app: the schema registered, the run named, the summary printed. The config is
harness.serve.config.ServeConfig, and the run is harness.serve.run's plan() and run(). Everything is checked before
the model is built (the knobs and the SLOs when the config is made; the stream, the budget against the longest
request in plan()), so bad input costs one line and writes nothing. The run's rows go to
<results_dir>/serve/<run_id>/ as it runs (harness.serve.rows): a run killed midway keeps its finished requests;
run.parquet, written last, holds the run row: vLLM benchmark_serving's metrics beside the planner's predicted
concurrency for the same pool.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.errors import exit_on_config_error
from harness.serve.config import ServeConfig
from harness.serve.rows import ServeRunWriter, serve_run_dir
from harness.serve.run import plan, run
from harness.serve.summary import summary_lines
from harness.store.summary import next_step

# An absolute path: a console script (kvbench-serve) calls main() from a wrapper, where Hydra would read a relative
# config_path as a Python package and find no conf/.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

log = logging.getLogger("kvbench")

ConfigStore.instance().store(name="serve_config", node=ServeConfig)


def run_names(cfg: ServeConfig, kv_dtype: str) -> tuple[str, str]:
    """(sweep_id, run_id): the sweep's (or the run's) Hydra folder name, and this run's folder name."""
    hc = HydraConfig.get()
    sweep_id = Path(hc.sweep.dir if hc.mode.name == "MULTIRUN" else hc.run.dir).name
    if cfg.run_id is not None:
        return sweep_id, cfg.run_id
    qps = "trace" if cfg.trace is not None else ("inf" if math.isinf(cfg.qps) else f"{cfg.qps:g}")
    suffix = f"-{hc.job.num}" if hc.mode.name == "MULTIRUN" else ""
    return sweep_id, f"{sweep_id}-{cfg.strategy}-{kv_dtype}-qps{qps}{suffix}"


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="serve")
@exit_on_config_error
def main(cfg: DictConfig) -> dict:
    serve_cfg = ServeConfig(**OmegaConf.to_container(cfg, resolve=True))  # validated here: one line if bad
    started = time.perf_counter()
    p = plan(serve_cfg)
    sweep_id, run_id = run_names(serve_cfg, p.kv_dtype)
    run_dir = serve_run_dir(serve_cfg.results_dir, run_id)
    ServeRunWriter(run_dir)  # refuses a folder that already holds a run, before the model is built
    log.info("serving %d requests, %d blocks of %d tokens (%s)", len(p.requests), p.num_blocks,
             serve_cfg.block_size, serve_cfg.strategy)  # fmt: skip
    row = run(p, run_dir=run_dir, sweep_id=sweep_id)
    print("\n".join(summary_lines(row, run_dir)) + f"\n  wall         {time.perf_counter() - started:.1f} s")
    print(next_step(run_dir, results_dir=serve_cfg.results_dir, page="Serving"))
    return {"run_dir": str(run_dir), "row": row}


if __name__ == "__main__":
    main()
