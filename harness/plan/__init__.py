"""The capacity planner: what a workload needs in memory and how much of it fits (ledger.py), the forward's
transient model (activations.py), and the runtime overhead and device memory, measured (runtime.py). A strategy's
share is its own layout's answer (harness/kv/<name>.py: LAYOUT)."""
