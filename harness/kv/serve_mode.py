"""How a strategy serves a request stream (harness.serve), declared as data beside its layout: Serving."""

from __future__ import annotations

from dataclasses import dataclass

SERVE_POOLS = ("blocks", "slots")  # Serving.pool: the kinds of pool harness.serve keeps the books of


@dataclass(frozen=True)
class Serving:
    """How a strategy serves a request stream (harness.serve), or that it does not and why: each
    harness/kv/<name>.py declares `SERVING` beside its LAYOUT, so that serving, like the planner, never knows a
    strategy by name.

    Data, not the serving classes: harness.serve builds its caches from this package, so a strategy names the kind
    of pool it is served from and harness.serve.kv_manager keeps that kind's books (an import of harness.serve here
    would be a cycle). pool "blocks": a paged pool, each request's block table grown as it computes (Kwon et al.
    2023); "slots": one slot of max_model_len tokens per running request, reserved whole at admission (Orca's).
    """

    pool: str | None  # one of SERVE_POOLS, or None: it does not serve (`refusal` says why)
    # The strategy whose cache holds the pool, built for serving (harness.serve.engine.build_cache); "": its own. A
    # blocks pool is a harness.kv.paged pool: sharing and what a window frees are the scheduler's block tables.
    storage: str = ""
    shares_prefix: bool = False  # requests share the cached blocks of a common prompt prefix (vLLM's enable_caching)
    windowed: bool = False  # a query reads its last sliding_window keys; the blocks before them are freed
    # The serving KV manager caps the blocks a running request holds below its length's (a window frees those it
    # has left): the planner then asks that manager what a request takes (KVManager.admission_blocks, peak_blocks)
    # instead of this strategy's static layout (harness.serve.concurrency.predict_concurrency).
    caps_blocks: bool = False
    # Whether its logits are exact serving's (paged at the same kv_dtype): False for one that drops K/V a query would
    # read (a window, an eviction policy), whose run then measures what that costs (harness.serve.accuracy).
    exact: bool = True
    # Each request holds at most cache.budget tokens, its blocks capped at ceil(budget / block_size): the module's own
    # serving cache over a paged pool (`serving_cache`, e.g. harness.kv.evict_paged) and a budget's KV manager
    # (harness.serve.evict_manager); its options reach the run as cache.<option>.
    budgeted: bool = False
    refusal: str = ""  # why it does not serve: the one line a serving run is refused with

    def __post_init__(self) -> None:
        if self.pool not in (*SERVE_POOLS, None):
            raise ValueError(f"Serving.pool: must be one of {', '.join(SERVE_POOLS)} or None, got {self.pool!r}")
        if (self.pool is None) != bool(self.refusal):
            raise ValueError("Serving.refusal: a strategy that does not serve says why, one that serves says nothing")
        if (self.shares_prefix or self.windowed or self.budgeted or self.caps_blocks) and self.pool != "blocks":
            raise ValueError("Serving: a shared prefix, a window and a budget are kept by block tables: pool 'blocks'")
        if (self.windowed or self.budgeted) and not self.caps_blocks:
            raise ValueError("Serving: a window or a budget caps the blocks a request holds: it needs caps_blocks")

    @classmethod
    def refused(cls, reason: str) -> Serving:
        return cls(pool=None, refusal=reason)

    @property
    def serves(self) -> bool:
        return self.pool is not None

    @property
    def paged(self) -> bool:
        """Blocks taken as a request grows, by block table; else a slot per request, addressed by its index."""
        return self.pool == "blocks"
