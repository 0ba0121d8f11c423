"""The run layer: one point measured in isolation (point, in a worker: runner; its prompts: prompts), resumed or held back by the sweep
(sweep), and make bench's side-by-side loops (versus). The only place where model, cache, timer and probes meet."""
