"""KV moving between tiers and processes: GB/s of blocks per tier and direction (tier_bandwidth.py), a payload of
named tensors between two processes over a real transport (transport.py), and prefill -> decode disaggregation
over it (disagg.py)."""
