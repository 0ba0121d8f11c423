"""How a point is measured: the step timer and adaptive repeats (timing.py), their statistics (stats.py), host
noise over the repeats (host_noise.py), memory probes (probes.py, over nvml.py on CUDA), the profiled pass
(profile.py), accuracy against the exact cache (accuracy.py), allocation waste with mixed lengths
(fragmentation.py), and where and with what a point ran (environment.py)."""
