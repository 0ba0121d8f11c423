"""A payload (name -> tensor) sent from one OS process to another over a real transport, loopback only.

What a KV connector does between a prefill and a decode instance (vLLM's P2P-NCCL and NIXL connectors, LMCache):
the sender hands over named tensors, the receiver ends with the same tensors, bit for bit, on its own device.

    shm   multiprocessing.shared_memory: the sender writes every tensor's bytes into one named segment (kept and
          reused while it is large enough, as a connector registers its buffers once) and signals over the peer
          pipe with the header; the receiver copies them out and acknowledges, so the segment is free again.
    tcp   a socket on 127.0.0.1, its port chosen by the OS (bind port 0) and passed to the sender over the peer pipe;
          per payload a header (8-byte length, then JSON: names, dtypes, shapes), then the raw bytes, which the
          receiver reads with recv_into straight into preallocated tensors. TCP_NODELAY: no Nagle delay on the
          header.
    gloo  torch.distributed, world size 2, point-to-point dist.send / dist.recv of each tensor's uint8 view; the
          header goes over the peer pipe (the metadata a connector exchanges out of band).
    nccl  the same on CUDA tensors, GPU to GPU; needs two GPUs (NCCL refuses two ranks on one device).

Loopback only. torch's default rendezvous (init_method tcp://...) starts a TCPStore server bound to every interface,
so here the store's server listens on a socket this module binds to 127.0.0.1 itself (master_listen_fd), and gloo's
and NCCL's own sockets are pinned to the loopback interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME = lo).

The staging is part of the transfer: shm, tcp and gloo move host memory, so a CUDA payload is copied to the host
first and to the device at the end. `bytes_sent` counts the payload exactly: the sum of the tensors' nbytes, never
a header.

Both ends open at the same time, each in its own process, and share a multiprocessing Pipe (`peer`) for the
handshake: open_sender(kind, peer=..., device=...) in one, open_receiver(kind, peer=..., device=...) in the other.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import struct
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import torch

TRANSPORTS = ("shm", "tcp", "gloo", "nccl")
LOOPBACK = "127.0.0.1"
TIMEOUT_S = 120  # a peer that has not answered by then is gone: raise instead of waiting forever
_LENGTH = struct.Struct("!Q")  # the tcp header's length prefix, bytes


def unsupported_reason(kind: str, device: torch.device) -> str | None:
    """Why `kind` cannot run on `device` here, or None."""
    if kind not in TRANSPORTS:
        return f"transport: unknown value {kind!r}; allowed: {', '.join(TRANSPORTS)}"
    if kind == "nccl" and device.type != "cuda":
        return f"transport nccl moves CUDA tensors, and this device is {device.type}; allowed here: shm, tcp, gloo"
    if kind == "nccl" and torch.cuda.device_count() < 2:
        return "transport nccl needs two GPUs: NCCL refuses two ranks on one device, and this machine has one"
    return None


def payload_bytes(parts: dict[str, torch.Tensor]) -> int:
    """The payload's size: the sum of its tensors' nbytes."""
    return sum(t.numel() * t.element_size() for t in parts.values())


def _header(parts: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in parts.items()]


def _empty(header, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for name, dtype, shape in header}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's storage as a flat uint8 view [nbytes] (fp8 and bf16 have no numpy dtype; bytes are bytes)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _on_host(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cpu().contiguous() for name, t in parts.items()}


def _recv_peer(peer: Connection):
    if not peer.poll(TIMEOUT_S):
        raise TimeoutError(f"transport: the peer sent nothing for {TIMEOUT_S} s")
    return peer.recv()


# --- shm -------------------------------------------------------------------------------------------------------------


class ShmSender:
    def __init__(self, peer: Connection) -> None:
        self.peer, self.segment, self.bytes_sent = peer, None, 0

    def send(self, parts: dict[str, torch.Tensor]) -> None:
        parts = _on_host(parts)
        total = payload_bytes(parts)
        if self.segment is None or self.segment.size < total:
            self.close()
            self.segment = SharedMemory(create=True, size=max(total, 1))
        window = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=total) if total else None
        offset = 0
        for t in parts.values():
            n = t.numel() * t.element_size()
            window[offset : offset + n].copy_(_as_bytes(t))
            offset += n
        del window  # no view of the segment may outlive the send: SharedMemory.close refuses while one exists
        self.peer.send(("shm", self.segment.name, _header(parts)))
        if _recv_peer(self.peer) != "ack":  # the receiver has copied out: the segment may be written again
            raise RuntimeError("transport shm: the receiver did not acknowledge")
        self.bytes_sent += total

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


class ShmReceiver:
    def __init__(self, peer: Connection, device: torch.device) -> None:
        self.peer, self.device, self.segment, self.bytes_received = peer, device, None, 0

    def recv(self) -> dict[str, torch.Tensor]:
        kind, name, header = _recv_peer(self.peer)
        assert kind == "shm", kind
        if self.segment is None or self.segment.name != name.lstrip("/"):
            self.close()
            self.segment = SharedMemory(name=name)
        parts = _empty(header, self.device)
        total = payload_bytes(parts)
        window = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=total) if total else None
        offset = 0
        for t in parts.values():
            n = t.numel() * t.element_size()
            _as_bytes(t).copy_(window[offset : offset + n])  # t is contiguous and fresh: its view is its storage
            offset += n
        del window
        self.peer.send("ack")
        self.bytes_received += total
        return parts

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()  # the sender, which created it, unlinks it
            self.segment = None


# --- tcp -------------------------------------------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("transport tcp: the sender closed the connection mid-payload")
        view = view[n:]


class TcpSender:
    def __init__(self, peer: Connection) -> None:
        port = _recv_peer(peer)
        self.sock = socket.create_connection((LOOPBACK, port), timeout=TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.sock.getpeername()[0] == LOOPBACK
        self.bytes_sent = 0

    def send(self, parts: dict[str, torch.Tensor]) -> None:
        parts = _on_host(parts)
        header = json.dumps(_header(parts)).encode()
        self.sock.sendall(_LENGTH.pack(len(header)) + header)
        for t in parts.values():
            if t.numel():
                self.sock.sendall(memoryview(_as_bytes(t).numpy()))
        self.bytes_sent += payload_bytes(parts)

    def close(self) -> None:
        self.sock.close()


class TcpReceiver:
    def __init__(self, peer: Connection, device: torch.device) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((LOOPBACK, 0))  # port 0: the OS picks a free one
        listener.listen(1)
        self.address = listener.getsockname()  # (host, port): loopback, asserted by the tests
        peer.send(self.address[1])
        listener.settimeout(TIMEOUT_S)
        self.sock, _ = listener.accept()
        listener.close()
        self.sock.settimeout(TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.device, self.bytes_received = device, 0

    def recv(self) -> dict[str, torch.Tensor]:
        length = bytearray(_LENGTH.size)
        _recv_exactly(self.sock, memoryview(length))
        header = bytearray(_LENGTH.unpack(length)[0])
        _recv_exactly(self.sock, memoryview(header))
        parts = _empty(json.loads(header), torch.device("cpu"))
        for t in parts.values():
            if t.numel():
                _recv_exactly(self.sock, memoryview(_as_bytes(t).numpy()))  # straight into the tensor's storage
        self.bytes_received += payload_bytes(parts)
        return {name: t.to(self.device) for name, t in parts.items()}

    def close(self) -> None:
        self.sock.close()


# --- torch.distributed: gloo, nccl -----------------------------------------------------------------------------------


def _init_group(kind: str, *, peer: Connection, rank: int, device: torch.device) -> None:
    """World size 2 over a TCPStore whose server listens on a socket bound to 127.0.0.1 (rank 0, the receiver,
    hosts it); gloo's and NCCL's own sockets on the loopback interface."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    timeout = dt.timedelta(seconds=TIMEOUT_S)
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((LOOPBACK, 0))
        listener.listen(8)
        store = dist.TCPStore(
            LOOPBACK, listener.getsockname()[1], 2, is_master=True, timeout=timeout,
            wait_for_workers=False, master_listen_fd=listener.detach(),
        )  # fmt: skip
        peer.send(store.port)
    else:
        store = dist.TCPStore(LOOPBACK, _recv_peer(peer), 2, is_master=False, timeout=timeout)
    if kind == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(kind, store=store, rank=rank, world_size=2, timeout=timeout)


class DistSender:
    def __init__(self, kind: str, peer: Connection, device: torch.device) -> None:
        _init_group(kind, peer=peer, rank=1, device=device)
        self.kind, self.peer, self.bytes_sent = kind, peer, 0

    def send(self, parts: dict[str, torch.Tensor]) -> None:
        import torch.distributed as dist

        parts = _on_host(parts) if self.kind == "gloo" else {n: t.contiguous() for n, t in parts.items()}
        self.peer.send(("dist", _header(parts)))
        for t in parts.values():
            if t.numel():
                dist.send(_as_bytes(t), dst=0)
        self.bytes_sent += payload_bytes(parts)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class DistReceiver:
    def __init__(self, kind: str, peer: Connection, device: torch.device) -> None:
        _init_group(kind, peer=peer, rank=0, device=device)
        self.kind, self.peer, self.device, self.bytes_received = kind, peer, device, 0

    def recv(self) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        _, header = _recv_peer(self.peer)
        parts = _empty(header, torch.device("cpu") if self.kind == "gloo" else self.device)
        for t in parts.values():
            if t.numel():
                dist.recv(_as_bytes(t), src=1)
        self.bytes_received += payload_bytes(parts)
        return {name: t.to(self.device) for name, t in parts.items()}

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


# --- the two ends ----------------------------------------------------------------------------------------------------


def open_sender(kind: str, *, peer: Connection, device: torch.device):
    """The sending end of `kind`; open_receiver must be called in the peer process at the same time."""
    reason = unsupported_reason(kind, device)
    if reason:
        raise ValueError(reason)
    if kind == "shm":
        return ShmSender(peer)
    if kind == "tcp":
        return TcpSender(peer)
    return DistSender(kind, peer, device)


def open_receiver(kind: str, *, peer: Connection, device: torch.device):
    """The receiving end of `kind`: recv() returns the payload on `device`."""
    reason = unsupported_reason(kind, device)
    if reason:
        raise ValueError(reason)
    if kind == "shm":
        return ShmReceiver(peer, device)
    if kind == "tcp":
        return TcpReceiver(peer, device)
    return DistReceiver(kind, peer, device)
