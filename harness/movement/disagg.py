"""Prefill -> decode disaggregation (PD), measured: one process prefills, a second decodes, the KV goes between them.

As vLLM's disaggregated prefill: the prefill instance computes the prompt's KV and a connector ships it to the
decode instance. Also as vLLM, the decode side receives the KV of the first P - 1 prompt tokens and computes the last
prompt token itself: that forward yields the logits of the first output token (a decode instance must compute at
least one token to sample one). So here the "first decode step" is the forward of the last prompt token on the decode
side, and ttft_pd_ms = prefill_ms + transfer_ms + first_step_ms. The prefill process computes those P - 1 tokens only
(vLLM's computes all P and drops the last token's KV): every prompt token is computed once, and the KV sent is a
state the cache was in, which int4 needs (its quantized groups and tail ring depend on the tokens written).

Both processes are spawned once (harness.run.runner's reasons: no fork of a process holding torch threads) and stay
warm for the whole sweep, each serving commands over a control pipe; they share a peer pipe for the transports'
handshakes (harness.movement.transport). Both build the same model from the same preset, seed and dtype, so both hold
identical weights.

Timing: prefill_ms in the prefill process (the forward of P - 1 tokens; perf_counter, device synchronized), first_step_ms and tpot_ms in the
decode process. transfer_ms runs from the sender's first byte (KV exported and the device synchronized, the clock read
just before the send) to the receiver's KV installed in its cache (device synchronized), both read with
time.monotonic_ns: CLOCK_MONOTONIC is one clock for every process of a Linux machine, so the difference of two
processes' readings is a duration. One untimed round first at every point; medians over `repeats` rounds (transfer,
decode) and over `prefill_repeats` rounds (the prefill and the colocated TTFT, the expensive part on a CPU).
ttft_colocated_ms: the same request prefilled (all P tokens) and its first token sampled in the decode process.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from harness.config import DTYPES
from harness.errors import Unsupported
from harness.kv.base import CacheSpec
from harness.kv.contiguous import ContiguousCache, Options
from harness.modeling.decode import decode_step, prefill
from harness.modeling.model import build_model
from harness.modeling.model_args import load_args
from harness.movement import transport

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = transport.TIMEOUT_S + 60  # a worker silent for longer is stuck or dead: restart both


@dataclass(frozen=True)
class PdSetup:
    """What both processes share: the model, the request's shape and the round counts."""

    model: str = "small"
    weights: str = "dummy"
    dtype: str = "fp32"
    device: str = "cpu"  # cpu or cuda (resolved)
    seed: int = 0
    batch_size: int = 1
    gen_len: int = 4
    max_context: int = 1024  # RoPE tables and caches are sized for max_context + gen_len
    kv_group_size: int = 32
    kv_residual: int = 0
    repeats: int = 5
    prefill_repeats: int = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """One process's model and caches (both roles: the decode side also serves the colocated baseline)."""

    def __init__(self, setup: PdSetup) -> None:
        self.setup, self.device = setup, torch.device(setup.device)
        self.args = load_args(setup.weights, setup.model)
        self.model = build_model(
            self.args, weights=setup.weights, dtype=DTYPES[setup.dtype], device=self.device, seed=setup.seed,
            n_positions=setup.max_context + setup.gen_len,
        )  # fmt: skip

    def prompt(self, context: int) -> torch.Tensor:
        """[B, context] ids, the same in both processes (a generator seeded by seed and context)."""
        generator = torch.Generator().manual_seed(self.setup.seed * 1_000_003 + context)
        ids = torch.randint(self.args.vocab_size, (self.setup.batch_size, context), generator=generator)
        return ids.to(self.device)

    def cache(self, kv_dtype: str, context: int) -> ContiguousCache:
        spec = CacheSpec.for_model(
            self.args, batch_size=self.setup.batch_size, max_tokens=context + self.setup.gen_len, kv_dtype=kv_dtype,
            device=self.device, kv_group_size=self.setup.kv_group_size, kv_residual=self.setup.kv_residual,
        )  # fmt: skip
        return ContiguousCache(spec, Options())

    def timed_prefill(self, kv_dtype: str, context: int) -> tuple[float, ContiguousCache, torch.Tensor]:
        """(ms, the filled cache, the first token [B]) of a prefill of all `context` prompt tokens."""
        cache, prompt = self.cache(kv_dtype, context), self.prompt(context)
        _sync(self.device)
        start = time.perf_counter()
        first = prefill(self.model, cache, prompt)
        _sync(self.device)
        return (time.perf_counter() - start) * 1e3, cache, first

    def decode_rest(self, cache: ContiguousCache, tokens: torch.Tensor, context: int) -> list[float]:
        """tokens [B, context + gen_len], its first output token at `context` -> each further step's ms; fills
        tokens in place."""
        steps_ms = []
        for pos in range(context, context + self.setup.gen_len - 1):
            start = time.perf_counter()
            tokens[:, pos + 1] = decode_step(self.model, cache, tokens, pos)
            _sync(self.device)
            steps_ms.append((time.perf_counter() - start) * 1e3)
        return steps_ms

    def timed_prefill_kv(self, kv_dtype: str, context: int) -> tuple[float, ContiguousCache]:
        """(ms, the filled cache) of the prefill instance's forward: the KV of the first context - 1 prompt tokens,
        no logits kept (the decode instance computes the last prompt token, whose logits give the first token)."""
        cache, prompt = self.cache(kv_dtype, context), self.prompt(context)
        _sync(self.device)
        start = time.perf_counter()
        self.model(prompt[:, : context - 1], start_pos=0, cache=cache, last_only=True)
        _sync(self.device)
        return (time.perf_counter() - start) * 1e3, cache

    def buffer(self, context: int) -> torch.Tensor:
        tokens = torch.zeros(
            (self.setup.batch_size, context + self.setup.gen_len), dtype=torch.long, device=self.device
        )
        tokens[:, :context] = self.prompt(context)
        return tokens


class PrefillRole:
    def __init__(self, engine: Engine, peer) -> None:
        self.engine, self.peer, self.sender, self.parts = engine, peer, None, None

    def handle(self, command: str, **kw) -> dict:
        if command == "open":
            self.sender = transport.open_sender(kw["kind"], peer=self.peer, device=self.engine.device)
            return {}
        if command == "close":
            if self.sender is not None:
                self.sender.close()
            self.sender = None
            return {}
        if command == "prefill":  # one untimed round, then prefill_repeats: the KV of the first P - 1 tokens
            rounds = [self.engine.timed_prefill_kv(kw["kv_dtype"], kw["context"]) for _ in range(1 + kw["repeats"])]
            self.parts = rounds[-1][1].export_kv(kw["context"] - 1)
            _sync(self.engine.device)
            return {"prefill_ms": [ms for ms, _ in rounds[1:]], "kv_bytes": transport.payload_bytes(self.parts)}
        if command == "send":
            before = self.sender.bytes_sent
            if transport._recv_peer(self.peer) != "ready":  # the decoder's cache is allocated and it is listening
                raise RuntimeError("the decode worker did not say it was ready")
            _sync(self.engine.device)
            first_byte_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process of the machine
            self.sender.send(self.parts)
            return {"first_byte_ns": first_byte_ns, "bytes_sent": self.sender.bytes_sent - before}
        raise ValueError(f"prefill worker: unknown command {command!r}")


class DecodeRole:
    def __init__(self, engine: Engine, peer) -> None:
        self.engine, self.peer, self.receiver = engine, peer, None

    def handle(self, command: str, **kw) -> dict:
        engine = self.engine
        if command == "open":
            self.receiver = transport.open_receiver(kw["kind"], peer=self.peer, device=engine.device)
            return {}
        if command == "close":
            if self.receiver is not None:
                self.receiver.close()
            self.receiver = None
            return {}
        kv_dtype, context = kw["kv_dtype"], kw["context"]
        if command == "colocated":  # prefill all P and sample the first token here, then decode on for the outputs
            ttft_ms = []
            for _ in range(1 + kw["repeats"]):
                ms, cache, first = engine.timed_prefill(kv_dtype, context)
                tokens = engine.buffer(context)
                tokens[:, context] = first
                engine.decode_rest(cache, tokens, context)
                ttft_ms.append(ms)
            return {"ttft_ms": ttft_ms[1:], "tokens": tokens[:, context:].tolist()}
        if command == "receive":
            cache = engine.cache(kv_dtype, context)  # allocated before the transfer: a decoder's KV memory is ready
            before = self.receiver.bytes_received
            self.peer.send("ready")  # the clock starts only once this end waits: its own set-up is not the transfer's
            cache.import_kv(self.receiver.recv(), context - 1)
            _sync(engine.device)
            installed_ns = time.monotonic_ns()
            tokens = engine.buffer(context)
            start = time.perf_counter()  # the first decode step: the last prompt token's forward -> first token
            tokens[:, context] = decode_step(engine.model, cache, tokens, context - 1)
            _sync(engine.device)
            first_step_ms = (time.perf_counter() - start) * 1e3
            steps_ms = engine.decode_rest(cache, tokens, context)
            return {
                "installed_ns": installed_ns,
                "bytes_received": self.receiver.bytes_received - before,
                "first_step_ms": first_step_ms,
                "steps_ms": steps_ms,
                "tokens": tokens[:, context:].tolist(),
            }
        raise ValueError(f"decode worker: unknown command {command!r}")


def serve(role: str, setup: PdSetup, control, peer) -> None:
    """A worker's loop: build the model once, then answer (command, kwargs) until None. A failure becomes a reply
    {"error": ...}; the worker goes on."""
    torch.set_grad_enabled(False)
    try:
        engine = Engine(setup)
        handler = (PrefillRole if role == "prefill" else DecodeRole)(engine, peer)
        control.send({"ready": True})
    except Exception as exc:  # the model did not build: nothing to serve
        control.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    while (message := control.recv()) is not None:
        command, kw = message
        try:
            with torch.inference_mode():
                control.send(handler.handle(command, **kw))
        except Unsupported as exc:  # this combination cannot run here (a format the model's shapes refuse)
            control.send({"unsupported": str(exc)})
        except Exception as exc:
            log.debug("%s worker: %s", role, traceback.format_exc())
            control.send({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]})


class Workers:
    """The prefill and the decode process, warm for the whole sweep; both are replaced after a failure."""

    def __init__(self, setup: PdSetup) -> None:
        self.setup, self.processes, self.controls = setup, {}, {}
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        peer_prefill, peer_decode = ctx.Pipe()
        for role, peer in (("prefill", peer_prefill), ("decode", peer_decode)):
            control, child_end = ctx.Pipe()
            process = ctx.Process(target=serve, args=(role, self.setup, child_end, peer), daemon=True)
            process.start()
            self.processes[role], self.controls[role] = process, control
        for role in self.controls:
            self._reply(role)

    def _reply(self, role: str) -> dict:
        control = self.controls[role]
        if not control.poll(REPLY_TIMEOUT_S):
            raise RuntimeError(f"the {role} worker did not answer in {REPLY_TIMEOUT_S} s")
        reply = control.recv()
        if "unsupported" in reply:
            raise Unsupported(reply["unsupported"])
        if "error" in reply:
            raise RuntimeError(f"{role} worker: {reply['error']}")
        return reply

    def call(self, role: str, command: str, **kw) -> dict:
        self.controls[role].send((command, kw))
        return self._reply(role)

    def both(self, prefill: tuple, decode: tuple) -> tuple[dict, dict]:
        """A command to each at once (the two ends of one transfer or handshake), both replies awaited, so that a
        failing end never leaves the other's reply unread."""
        self.controls["prefill"].send((prefill[0], prefill[1]))
        self.controls["decode"].send((decode[0], decode[1]))
        replies, errors = {}, []
        for role in ("prefill", "decode"):
            try:
                replies[role] = self._reply(role)
            except (RuntimeError, Unsupported) as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))
        return replies["prefill"], replies["decode"]

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        for role, process in self.processes.items():
            with contextlib.suppress(BrokenPipeError, OSError):  # a dead worker's pipe is already closed
                self.controls[role].send(None)
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes, self.controls = {}, {}


def median(values: list[float]) -> float:
    return statistics.median(values)


def measure_point(
    workers: Workers, *, kind: str, kv_dtype: str, context: int, prefilled: dict, colocated: dict
) -> dict:
    """One (transport, kv_dtype, context) row's measured columns. prefilled and colocated: the prefill worker's and
    the colocated replies for this (kv_dtype, context), measured once for every transport."""
    setup = workers.setup
    workers.both(("open", {"kind": kind}), ("open", {"kind": kind}))
    try:
        transfers_ms, first_steps_ms, steps_ms, matches, sent, received = [], [], [], [], set(), set()
        for round_index in range(1 + setup.repeats):  # round 0: untimed
            sender, receiver = workers.both(("send", {}), ("receive", {"kv_dtype": kv_dtype, "context": context}))
            sent.add(sender["bytes_sent"])
            received.add(receiver["bytes_received"])
            matches.append(receiver["tokens"] == colocated["tokens"])
            if round_index:
                transfers_ms.append((receiver["installed_ns"] - sender["first_byte_ns"]) / 1e6)
                first_steps_ms.append(receiver["first_step_ms"])
                steps_ms.extend(receiver["steps_ms"])
    finally:
        workers.both(("close", {}), ("close", {}))
    if sent != {prefilled["kv_bytes"]} or received != sent:
        raise RuntimeError(f"bytes: exported {prefilled['kv_bytes']}, sent {sorted(sent)}, received {sorted(received)}")
    transfer_ms, prefill_ms, first_step_ms = (
        median(transfers_ms),
        median(prefilled["prefill_ms"]),
        median(first_steps_ms),
    )
    tpot_ms = median(steps_ms) if steps_ms else None
    return {
        "kv_bytes": prefilled["kv_bytes"],
        "transfer_ms": transfer_ms,
        "transfer_gbps": prefilled["kv_bytes"] / (transfer_ms * 1e6),
        "transfer_samples_ms": transfers_ms,
        "prefill_ms": prefill_ms,
        "first_step_ms": first_step_ms,
        "ttft_pd_ms": prefill_ms + transfer_ms + first_step_ms,
        "ttft_colocated_ms": median(colocated["ttft_ms"]),
        "tpot_ms": tpot_ms,
        "transfer_over_step": transfer_ms / tpot_ms if tpot_ms else None,
        "outputs_match": all(matches),
        "repeats": setup.repeats,
    }
