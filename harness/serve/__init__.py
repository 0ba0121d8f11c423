"""Serving: the KV cache as the resource a serving engine schedules (issue #16).

A request stream (requests.py: arrivals, lengths, traces) and what a serving run reports (metrics.py: per-request
latencies and the run's throughput, percentiles and goodput, with vLLM's benchmark_serving names). The engine loop
over the paged pool comes on top of these.
"""
