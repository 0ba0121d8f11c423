"""Tier loads that run ahead of use (tier_overlap): disk blocks prefetched while their request waits, and an
iteration's loads copied into the pool layer by layer while the forward computes.

Two overlaps, after SGLang HiCache and LMCache:
- Prefetch (HiCache's storage prefetch, L3 -> L2, started when a request arrives, not when it is admitted): a
  loader thread reads the request's disk block files and checks their checksums (harness.kv.block_file) while the
  request waits in the queue behind other requests' forwards, into host staging (page-locked on CUDA). The lookup
  at admission finds a block already verified, or waits for a read in flight, or reads a block not yet started
  itself. Either way a block is counted as a hit only once it has passed its checksum: a refused file is a miss
  before the scheduler counts it, exactly as without overlap, so no hit is ever taken back (the case vLLM's KV
  connector handles by recomputing from the first invalid block, its `kv_load_failure_policy=recompute`, cannot
  arise here).
- Layerwise load-back (HiCache's load_back with its layer_done_counter; LMCache's layerwise retrieval, "the forward
  staggers through its layers as each one's KV is received"): the verified blocks go into their pool blocks one
  layer at a time, all blocks of layer l before layer l + 1, and the forward's attention at layer l waits only for
  layer l (PagedCache.wait_layer): the suffix prefill's first layers run while the later layers are copied in. On
  the CPU a loader thread copies (threading.Event per layer); on CUDA the copies are queued on a side stream from
  page-locked staging with a CUDA event per layer, which the compute stream waits on (no host sync).

Times: `busy_s` is the loads' own time (file reads with checksums, copies into the pool), `wait_s` the time the
forward or the lookup spent blocked on them; of the loader thread's time, what nobody waited for ran while the host
did other work (the forward, the other requests): `hidden_s`. On CUDA the layer copies run on the device; their time is the side
stream's (CUDA events), and the compute stream's waits are on the device too: there the hidden share counts the
prefetch's host time only (the copies' hiding shows in TTFT, not in these columns).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.kv import host

URGENT, BACKGROUND = 0, 1  # a forward's layer copies go before any prefetch read


@dataclass
class LoadTimes:
    """Seconds of load work and of waiting for it, summed over a run. Each field has one writer: the loader thread
    adds to thread_s, the main thread to inline_s and wait_s, so no update is lost between them."""

    thread_s: float = 0.0  # the loader thread's loads: reads, checksums, copies
    inline_s: float = 0.0  # loads the main thread ran itself (a lookup's read; every load without overlap)
    wait_s: float = 0.0  # the main thread blocked on the loader's

    @property
    def busy_s(self) -> float:
        """The loads' own time, wherever they ran."""
        return self.thread_s + self.inline_s

    @property
    def hidden_s(self) -> float:
        """What ran while the main thread did other work: the loader's time it did not wait for."""
        return max(0.0, self.thread_s - self.wait_s)


class Loader:
    """One daemon thread running tasks by priority (URGENT first), FIFO within a priority. A task's exception is
    kept and raised by whoever waits on it (Prefetch.result, LayerLoads.wait), never lost in the thread."""

    def __init__(self, times: LoadTimes) -> None:
        self.times = times
        self._heap: list[tuple[int, int, Callable[[], None] | None]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-tier-loader", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """The thread ends once the tasks queued before this have run (its owner is gone: weakref.finalize)."""
        self.submit(BACKGROUND + 1, None)

    def submit(self, priority: int, task: Callable[[], None] | None) -> None:
        with self._ready:
            heapq.heappush(self._heap, (priority, next(self._order), task))
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._heap:
                    self._ready.wait()
                _, _, task = heapq.heappop(self._heap)
            if task is None:
                return
            start = time.perf_counter()
            with torch.no_grad():
                task()  # tasks catch their own errors (they hand them to their waiter)
            self.times.thread_s += time.perf_counter() - start  # this thread alone adds to it


@dataclass
class Prefetch:
    """One disk block's read ahead of its lookup: queued, then running or taken by the lookup, then done."""

    key: bytes
    state: str = "queued"  # queued | running | taken (the lookup reads it itself) | cancelled | done
    block: dict[str, torch.Tensor] | None = None  # verified, on the host (page-locked on CUDA); None: a miss
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def staged(cls, key: bytes, block: dict[str, torch.Tensor]) -> Prefetch:
        """A block already read and verified (a lookup's whose request was not admitted), kept for its next one."""
        prefetch = cls(key, state="done", block=block)
        prefetch.done.set()
        return prefetch

    def claim(self, to: str) -> bool:
        """Move from queued to `to` (running: the loader; taken or cancelled: the main thread); False: too late."""
        with self.lock:
            if self.state != "queued":
                return False
            self.state = to
            return True

    def result(self, times: LoadTimes) -> dict[str, torch.Tensor] | None:
        """The verified block, waiting (timed) for a read in flight."""
        if not self.done.is_set():
            start = time.perf_counter()
            self.done.wait()
            times.wait_s += time.perf_counter() - start
        if self.error is not None:
            raise self.error
        return self.block


def read_task(prefetch: Prefetch, read: Callable[[bytes], dict[str, torch.Tensor] | None], pin: bool):
    """The loader's task for one prefetch: the file read and checked, staged on the host."""

    def task() -> None:
        if not prefetch.claim("running"):
            return  # taken by the lookup or cancelled first
        try:
            block = read(prefetch.key)
            if block is not None and pin:  # page-locked staging, so that the h2d copy runs at the bus's speed
                block = {name: host.pinned(t) for name, t in block.items()}
            prefetch.block = block
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter, raised there)
            prefetch.error = exc
        prefetch.state = "done"
        prefetch.done.set()

    return task


class LayerLoads:
    """One iteration's loads, layer by layer: `blocks` (pool block ids) filled from `staged` host blocks (each
    name -> [L, 1, H_kv, rows, width], read_blocks' shape for one block). Started by `start`; the forward calls
    wait(layer) before it reads layer's K/V, and finish() before the next iteration touches the pool."""

    def __init__(self, cache, blocks: list[int], staged: list[dict[str, torch.Tensor]], times: LoadTimes) -> None:
        self.cache, self.times = cache, times
        self.n_layers = cache.rows["k"].shape[0]
        self.device = cache.spec.device
        # [L, n, H_kv, rows, width] per part: the iteration's blocks side by side (page-locked on CUDA)
        self.parts = {name: torch.cat([block[name] for block in staged], dim=1) for name in staged[0]}
        if self.device.type == "cuda":  # page-locked staging (harness.kv.host's seam), so the copies are async
            self.parts = {name: host.pinned(part) for name, part in self.parts.items()}
        self.index = torch.tensor(blocks, dtype=torch.long)
        self.n_bytes = sum(t.numel() * t.element_size() for t in self.parts.values())
        self.ready = [threading.Event() for _ in range(self.n_layers)]
        self.error: BaseException | None = None
        self.events: list = []  # CUDA: one event per layer, recorded on the side stream
        self.seconds = 0.0  # the copies' own time (CPU: the thread's; CUDA: the side stream's, at finish)

    def _copy_layer(self, layer: int, index: torch.Tensor) -> None:
        """Layer `layer` of every block into the pool: one index_copy_ per part, on whatever stream is current."""
        for name, pool in self.cache.rows.items():
            if pool is None:
                continue
            part = self.parts[name][layer].to(pool.device, non_blocking=True)  # [n, H_kv, rows, width]
            target = pool[layer]  # [N, H_kv, rows, width]
            if target.element_size() == 1:  # as bytes: the CPU's index_copy_ has no float8 kernel
                target, part = target.view(torch.uint8), part.view(torch.uint8)
            target.index_copy_(0, index, part)

    def start(self, loader: Loader | None, stream=None) -> None:
        """CPU: the layers copied by `loader`, in order, each's Event set when it is in. CUDA: every layer's copy
        queued on `stream` behind the compute stream's work so far (this iteration's offloads read the same
        blocks), an event recorded after each."""
        if self.device.type == "cuda":
            self.index = host.pinned(self.index)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            start = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                index = self.index.to(self.device, non_blocking=True)  # [n] block ids, on the side stream
                for layer in range(self.n_layers):
                    self._copy_layer(layer, index)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(stream)
                    self.events.append(event)
            self._start_event = start
            return

        def task() -> None:
            try:
                for layer in range(self.n_layers):
                    t0 = time.perf_counter()
                    self._copy_layer(layer, self.index)
                    self.seconds += time.perf_counter() - t0
                    self.ready[layer].set()
            except BaseException as exc:  # noqa: BLE001  (raised by the forward's wait)
                self.error = exc
                for event in self.ready:
                    event.set()

        loader.submit(URGENT, task)

    def wait(self, layer: int) -> None:
        """Before layer's attention reads K/V: that layer's blocks are in (CUDA: the compute stream waits for its
        event, on the device; CPU: the host waits, timed)."""
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])
            return
        if not self.ready[layer].is_set():
            start = time.perf_counter()
            self.ready[layer].wait()
            self.times.wait_s += time.perf_counter() - start
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """Every layer in before the next iteration touches the pool (a forward that skipped a layer's wait waits
        here). CUDA: the compute stream waits for the last event, on the device: no host sync."""
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[-1])
            # The staging may go: the caching host allocator keeps a page-locked block until the copies that read
            # it are done (it records an event on each non-blocking copy).
            self.parts, self.cache = {}, None
            return
        for layer in range(self.n_layers):
            self.wait(layer)

    def copy_seconds(self) -> float:
        """The copies' own time, after finish (CUDA: the side stream's events, read once they are done, at the
        run's end, so that no iteration syncs for them)."""
        if self.events:
            self.events[-1].synchronize()
            self.seconds = self._start_event.elapsed_time(self.events[-1]) / 1e3  # ms -> s
        return self.seconds
