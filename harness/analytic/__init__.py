"""The analytic models, each figure beside the measured one that checks it.

The planner: what a workload needs in memory and how much of it fits (ledger.py), the forward's transient model
(activations.py, activations_mla.py), and the runtime overhead and device memory, measured (runtime.py). A
strategy's share is its own layout's answer (harness/kv/<name>.py: LAYOUT). The step model: FLOPs and bytes of a
prefill and a decode step (roofline.py, roofline_mla.py) and a point's verdict against the ceilings
(roofline_row.py). Read from a sweep: the observed knee of a batch sweep (crossover.py) and when loading a stored
prefix beats recomputing it (reuse.py).
"""
