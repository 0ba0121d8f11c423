"""harness.movement.transport: a payload of mixed dtypes crosses from this process to a spawned one, bit for bit, on loopback."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from harness.movement import transport

CPU = torch.device("cpu")


def payload(scale: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(scale)
    x = torch.randn((3, 5 * scale, 7), generator=generator)
    return {
        "fp32": x,
        "bf16": x.to(torch.bfloat16),
        "int8": (x * 40).clamp(-127, 127).to(torch.int8),
        "uint8": torch.randint(256, (11 * scale,), generator=generator, dtype=torch.uint8),
        "fp8": x.to(torch.float8_e4m3fn),
        "empty": torch.zeros((0, 4)),
    }


def receiving_end(control, peer) -> None:
    """The spawned peer: per kind it is told, open the receiver, take `n` payloads, send them back with what it saw."""
    while (job := control.recv()) is not None:
        kind, n = job
        receiver = transport.open_receiver(kind, peer=peer, device=CPU)
        got = [receiver.recv() for _ in range(n)]
        address = getattr(receiver, "address", None)
        control.send((got, receiver.bytes_received, address))
        receiver.close()


@pytest.fixture(scope="module")
def peer_process():
    ctx = mp.get_context("spawn")
    peer_here, peer_there = ctx.Pipe()
    control, control_there = ctx.Pipe()
    process = ctx.Process(target=receiving_end, args=(control_there, peer_there), daemon=True)
    process.start()
    yield control, peer_here
    control.send(None)
    process.join(timeout=30)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(transport._as_bytes(a), transport._as_bytes(b))


@pytest.mark.parametrize("kind", ["shm", "tcp", "gloo"])
def test_a_mixed_payload_arrives_bit_exact_in_another_process_and_its_bytes_are_counted(peer_process, kind):
    control, peer = peer_process
    sent = [payload(1), payload(3)]  # the second is larger: shm grows its segment, tcp and gloo reuse the channel
    control.send((kind, len(sent)))
    sender = transport.open_sender(kind, peer=peer, device=CPU)
    for parts in sent:
        sender.send(parts)
    got, bytes_received, address = control.recv()
    sender.close()
    expected_bytes = sum(t.numel() * t.element_size() for parts in sent for t in parts.values())
    assert sender.bytes_sent == bytes_received == expected_bytes
    for parts, arrived in zip(sent, got, strict=True):
        assert list(arrived) == list(parts)
        assert all(same_bits(parts[name], arrived[name]) for name in parts)
    if kind == "tcp":
        assert address[0] == transport.LOOPBACK  # the receiver listened on loopback, nowhere else


def test_nccl_on_the_cpu_is_unsupported_with_a_reason():
    reason = transport.unsupported_reason("nccl", CPU)
    assert reason and "CUDA" in reason


def test_an_unknown_transport_names_the_allowed_ones():
    reason = transport.unsupported_reason("udp", CPU)
    assert "udp" in reason and "shm, tcp, gloo, nccl" in reason


def test_payload_bytes_is_the_sum_of_the_tensors_nbytes():
    parts = payload(1)
    assert transport.payload_bytes(parts) == 4 * 105 + 2 * 105 + 105 + 11 + 105 + 0
