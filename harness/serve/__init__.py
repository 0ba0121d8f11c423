"""Serving: the KV cache as the resource a serving engine schedules (issue #16).

A request stream (requests.py), the KV budget and the planner's concurrency (capacity.py), block accounting per
strategy (kv_manager.py, over block_pool.py), the scheduler (scheduler.py), the engine that runs its iterations on
the real model (engine.py), what a run reports (metrics.py; whether it sustained its rate, sustained.py) and
writes (rows.py), a qps sweep's knees and fleet (fleet.py), and transformers' engine as the peer (peer.py); the run's config (config.py), the run planned and served
(run.py) and its printed summary (summary.py). The entry point is experiments/serve.py.
"""
