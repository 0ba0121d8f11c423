"""One KV block as one file: the disk tier's unit (LMCache's local_disk backend likewise keeps one file per chunk key).

A block is every layer's K and V for its tokens, plus a quantized format's scales: the parts PagedCache.read_blocks
returns, name -> [L, n, H_kv, rows, width] in any dtype (fp32, bf16, fp16, int8 codes, uint8 packed int4, fp8, fp32
scales). The file is

    [header: MAGIC, a little-endian uint64 length, the header JSON; zero-padded to a multiple of ALIGN]
    [part 0 at an ALIGN-aligned offset][zero padding][part 1 ...] ...

The header holds the format version, the caller's identity (model, weights, layers, kv_dtype, block size ...), each
part's name, dtype, shape, offset and bytes, a CRC-32 of the payload and one of the header itself. `read_block`
checks all of it and raises BlockRejected, never returns KV that does not match: a stored block must be a miss with a
warning, never wrong KV (issue #18).

Files are written atomically (a hidden temp name beside the final one, fsync, os.replace, fsync of the folder, as
harness/store/atomic.py does), and with O_DIRECT where the filesystem allows it, so that a write is timed to the
disk and a read comes from it, not from the page cache. Where O_DIRECT is refused (EINVAL: tmpfs, some network
filesystems) the I/O is buffered, the written pages are dropped after the fsync and again before a read
(posix_fadvise DONTNEED), and IOStats says so.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.store.atomic import TEMP_MARKER, fsync_directory

FILE_SUFFIX = ".kvblock"
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers: the page size, a multiple of any logical block
MAGIC = b"KVBLOCK\n"  # the first 8 bytes of every block file
FORMAT_VERSION = 1  # bump when the layout changes: older files are then rejected, not misread
_LENGTH = struct.Struct("<Q")  # the header JSON's length in bytes, after MAGIC
_PREFIX_BYTES = len(MAGIC) + _LENGTH.size
# Filesystems whose files live in the page cache: there a read cannot be cold, whatever is dropped.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
# Linux caps one read()/write() at 0x7ffff000 bytes (2 GiB - 4 KiB, an ALIGN multiple): larger blocks loop.
MAX_IO_BYTES = 0x7FFFF000


class BlockRejected(Exception):
    """A stored block that must not be used. str(exc) is one line naming the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"KV block {self.path}: {reason}")


@dataclass(frozen=True)
class IOStats:
    n_bytes: int  # payload bytes (the parts), not the header or the padding
    seconds: float  # wall time of the I/O (write: staging, write, fsync, rename; read: including the checksum check)
    direct_io: bool  # O_DIRECT was used
    cold: bool  # read: the pages were not in the page cache (O_DIRECT, or dropped with posix_fadvise before reading)


def block_path(directory: Path, key: bytes) -> Path:
    """directory / <first two hex digits> / <key hex>.kvblock: 256 folders keep any one folder short."""
    name = key.hex()
    return Path(directory) / name[:2] / f"{name}{FILE_SUFFIX}"


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (the longest /proc/mounts mount point above it), or None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best, best_type = str(Path(path).resolve()), "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best_type


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "float8_e4m3fn", "bfloat16", "uint8": getattr(torch, name) inverts it


def _checksum(buffer: memoryview, parts: list[dict]) -> int:
    # CRC-32 (zlib): it detects corruption (a flipped bit, a torn or truncated write), not an adversary, which is
    # all a local cache needs; zlib's is ~3 GB/s a core here, and its cost is part of every timed read.
    crc = 0
    for part in parts:
        crc = zlib.crc32(buffer[part["offset"] : part["offset"] + part["nbytes"]], crc)
    return crc


def _header_checksum(header: dict) -> int:
    """CRC-32 of the header's canonical JSON without its own checksum: a flipped digit in a shape is caught too."""
    rest = {k: v for k, v in header.items() if k != "header_crc32"}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _open(path: Path, flags: int, *, direct: bool) -> tuple[int, bool]:
    """os.open with O_DIRECT when asked and allowed; (fd, whether O_DIRECT is on)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                raise
    return os.open(path, flags, 0o644), False


def _drop_cached_pages(fd: int) -> bool:
    """Ask the kernel to drop the file's clean pages from the page cache; whether it could be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def _write_all(fd: int, buffer: memoryview) -> None:
    done = 0
    while done < len(buffer):
        done += os.write(fd, buffer[done : done + MAX_IO_BYTES])


def _read_all(fd: int, buffer: memoryview, n_bytes: int) -> int:
    """Read up to n_bytes (an ALIGN multiple) into buffer from offset 0; returns the bytes read (short at EOF)."""
    done = 0
    while done < n_bytes:
        got = os.preadv(fd, [buffer[done : done + min(MAX_IO_BYTES, n_bytes - done)]], done)
        if got == 0:
            break
        done += got
    return done


def _encode_header(parts: dict[str, torch.Tensor], identity: dict) -> tuple[dict, list[dict], int]:
    """The header (without its checksums), its part entries with their offsets, and the file's padded bytes."""
    entries = [
        {"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}
        for name, t in parts.items()
    ]
    header = {"version": FORMAT_VERSION, "identity": identity, "parts": entries, "payload_crc32": 0}
    # The offsets depend on the header's padded size, which depends on the offsets' digits: grow until it fits.
    header_bytes = ALIGN
    while True:
        offset = header_bytes
        for entry in entries:
            entry["offset"] = offset
            offset = _round_up(offset + entry["nbytes"])
        needed = _round_up(_PREFIX_BYTES + len(json.dumps(header)) + 64)  # 64: room for both checksums' digits
        if needed <= header_bytes:
            return header, entries, offset
        header_bytes = needed


def write_block(path: Path, parts: dict[str, torch.Tensor], *, identity: dict, direct: bool = True) -> IOStats:
    """Store `parts` (name -> tensor, any device and dtype) under `identity` (a JSON-able dict) as the file `path`.

    Atomic: a crash or an error leaves the old file or none under `path`, never half a block. The payload is
    staged in one page-aligned buffer (an anonymous mmap), written in one go with O_DIRECT when the filesystem
    allows it, and fsynced; the seconds cover staging, write, fsync and rename."""
    path = Path(path)
    started = time.perf_counter()
    parts = {name: t.detach().to("cpu").contiguous() for name, t in parts.items()}
    identity = json.loads(json.dumps(identity))  # as read back: tuples become lists; not JSON-able raises here
    header, entries, total = _encode_header(parts, identity)
    # Anonymous: page-aligned and zero-filled, as O_DIRECT needs; unmapped when the last reference goes (not closed
    # here: a failed write's traceback may still hold a slice of it).
    buffer = mmap.mmap(-1, total)
    view = memoryview(buffer)
    staged = torch.frombuffer(buffer, dtype=torch.uint8)  # [total] over the same bytes
    for entry, tensor in zip(entries, parts.values(), strict=True):
        if entry["nbytes"]:
            staged[entry["offset"] : entry["offset"] + entry["nbytes"]].copy_(tensor.reshape(-1).view(torch.uint8))
    header["payload_crc32"] = _checksum(view, entries)
    header["header_crc32"] = _header_checksum(header)
    text = json.dumps(header).encode()
    assert _PREFIX_BYTES + len(text) <= (entries[0]["offset"] if entries else total), "header overflows"
    view[: _PREFIX_BYTES + len(text)] = MAGIC + _LENGTH.pack(len(text)) + text
    used_direct = _write_file(path, view, direct=direct)
    n_bytes = sum(e["nbytes"] for e in entries)
    return IOStats(n_bytes=n_bytes, seconds=time.perf_counter() - started, direct_io=used_direct, cold=False)


def _write_file(path: Path, view: memoryview, *, direct: bool) -> bool:
    """view -> a temp file beside `path`, fsynced, renamed over `path`; returns whether O_DIRECT was used."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = None
    try:
        fd, used_direct = _open(tmp_path, flags, direct=direct)
        try:
            _write_all(fd, view)
        except OSError as exc:
            if not used_direct or exc.errno != errno.EINVAL:
                raise
            os.close(fd)  # the open took O_DIRECT but the write refused it (some FUSE filesystems): buffered
            fd, used_direct = _open(tmp_path, os.O_WRONLY | os.O_TRUNC, direct=False)
            _write_all(fd, view)
        os.fsync(fd)
        if not used_direct:
            _drop_cached_pages(fd)  # clean after the fsync: the next read goes to the disk
        os.close(fd)
        fd = None
        os.replace(tmp_path, path)
    except BaseException:
        if fd is not None:
            os.close(fd)
        tmp_path.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # the rename itself survives a power loss
    return used_direct


def _parse_header(path: Path, view: memoryview, n_read: int) -> dict:
    if n_read < _PREFIX_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise BlockRejected(path, f"unreadable header: not a kvbench block file ({n_read} bytes, no {MAGIC!r})")
    (length,) = _LENGTH.unpack(view[len(MAGIC) : _PREFIX_BYTES])
    if _PREFIX_BYTES + length > n_read:
        raise BlockRejected(path, f"truncated: the header needs {_PREFIX_BYTES + length} bytes, the file has {n_read}")
    try:
        header = json.loads(bytes(view[_PREFIX_BYTES : _PREFIX_BYTES + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockRejected(path, f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise BlockRejected(path, "unreadable header: not a JSON object")
    if header.get("version") != FORMAT_VERSION:
        raise BlockRejected(path, f"format version {header.get('version')!r}, this reader knows {FORMAT_VERSION}")
    if header.get("header_crc32") != _header_checksum(header):
        raise BlockRejected(path, "header checksum mismatch: the header was altered or corrupted")
    return header


def _check_identity(path: Path, stored: object, expected: dict) -> None:
    if not isinstance(stored, dict):
        raise BlockRejected(path, "unreadable header: no identity")
    for name in sorted(set(stored) | set(expected)):
        if stored.get(name) != expected.get(name):
            raise BlockRejected(
                path, f"identity field {name!r} differs: stored {stored.get(name)!r}, expected {expected.get(name)!r}"
            )


def _check_part(path: Path, entry: object, n_read: int) -> tuple[str, torch.dtype, list[int], int, int]:
    """A header part entry -> (name, dtype, shape, offset, nbytes), each consistent with the others and the file."""
    try:
        name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
        offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    except (TypeError, KeyError, ValueError) as exc:
        raise BlockRejected(path, f"a part entry of the header is incomplete ({exc!r})") from None
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise BlockRejected(path, f"part {name!r}: unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BlockRejected(path, f"part {name!r}: bad shape {shape!r}")
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise BlockRejected(path, f"part {name!r}: {nbytes} bytes, but {dtype_name} {shape} holds {expected}")
    if offset % ALIGN or offset < _PREFIX_BYTES:
        raise BlockRejected(path, f"part {name!r}: offset {offset} is not a multiple of {ALIGN} past the header")
    if offset + nbytes > n_read:
        raise BlockRejected(
            path, f"truncated: part {name!r} ends at byte {offset + nbytes}, the file has {n_read} (payload short)"
        )
    return name, dtype, shape, offset, nbytes


def read_block(path: Path, *, identity: dict, direct: bool = True) -> tuple[dict[str, torch.Tensor], IOStats]:
    """The parts stored in `path` as CPU tensors (views into one page-aligned buffer they keep alive), and how the
    read went; BlockRejected when the file is missing, truncated, foreign (another identity or format version) or
    corrupt (a checksum), so that a caller never uses KV that is not what it asked for.

    Cold: with O_DIRECT the read bypasses the page cache; without it the file's pages are dropped first
    (posix_fadvise DONTNEED), which a memory filesystem (tmpfs) cannot do."""
    path = Path(path)
    started = time.perf_counter()
    expected_identity = json.loads(json.dumps(identity))  # compare as stored: tuples are lists in JSON
    try:
        fd, used_direct = _open(path, os.O_RDONLY, direct=direct)
    except FileNotFoundError:
        raise BlockRejected(path, "missing: no such file") from None
    except OSError as exc:
        raise BlockRejected(path, f"cannot open: {exc.strerror}") from None
    try:
        cold = used_direct
        if not used_direct:
            fs_type = filesystem_type(path)
            cold = _drop_cached_pages(fd) and fs_type is not None and fs_type not in MEMORY_FILESYSTEMS
        size = os.fstat(fd).st_size
        buffer = mmap.mmap(-1, max(_round_up(size), ALIGN))  # page-aligned, an ALIGN multiple: O_DIRECT's rules
        view = memoryview(buffer)
        n_read = _read_all(fd, view, len(buffer))
    except OSError as exc:
        raise BlockRejected(path, f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    header = _parse_header(path, view, n_read)
    _check_identity(path, header.get("identity"), expected_identity)
    entries = header.get("parts")
    if not isinstance(entries, list):
        raise BlockRejected(path, "unreadable header: no part list")
    checked = [_check_part(path, entry, n_read) for entry in entries]
    spans = [{"offset": offset, "nbytes": nbytes} for _, _, _, offset, nbytes in checked]
    crc = _checksum(view, spans)
    if crc != header.get("payload_crc32"):
        raise BlockRejected(path, f"payload checksum mismatch: stored {header.get('payload_crc32')}, read {crc}")
    parts = {}
    for name, dtype, shape, offset, nbytes in checked:
        if nbytes == 0:
            parts[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)  # holds `buffer` alive
        parts[name] = raw.view(dtype).reshape(shape)
    n_bytes = sum(span["nbytes"] for span in spans)
    return parts, IOStats(n_bytes=n_bytes, seconds=time.perf_counter() - started, direct_io=used_direct, cold=cold)
