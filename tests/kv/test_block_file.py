"""A KV block as one file (harness/kv/block_file.py): bit-exact round trips, O_DIRECT where the filesystem allows
it, atomic writes, and a BlockRejected naming the file and the reason for every way a stored block can be wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness.kv import block_file
from harness.kv.block_file import ALIGN, BlockRejected, block_path, read_block, write_block

IDENTITY = {"model": "tiny", "weights": None, "n_layers": 2, "kv_dtype": "int4", "block_size": 16, "shape": (1, 2)}


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns of `dtype` (fp8 and bf16 included, NaN patterns too): a round trip must keep each."""
    n_bytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=generator())
    return raw.view(dtype).reshape(shape)


# Every dtype a cache stores, in read_blocks' shapes [L, n, H_kv, rows, width]: plain K/V, int8 and fp8 codes, int4
# packed two to a uint8, and fp32 scales (a rows=1, width=1 part, smaller than one ALIGN page).
PARTS = {
    "k": random_bytes((2, 1, 2, 16, 8), torch.float32),
    "v": random_bytes((2, 1, 2, 16, 8), torch.bfloat16),
    "k_half": random_bytes((2, 1, 2, 16, 8), torch.float16),
    "k_int8": random_bytes((2, 1, 2, 16, 8), torch.int8),
    "k_int4": random_bytes((2, 1, 2, 16, 4), torch.uint8),
    "k_fp8": random_bytes((2, 1, 2, 16, 8), torch.float8_e4m3fn),
    "k_scale": random_bytes((2, 1, 2, 1, 1), torch.float32),
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def on_o_direct_filesystem(path) -> bool:
    probe = path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def stored(tmp_path):
    path = block_path(tmp_path, b"\xab\xcd" * 16)
    write_block(path, PARTS, identity=IDENTITY)
    return path


def test_the_path_is_the_key_in_hex_under_its_first_two_digits(tmp_path):
    assert block_path(tmp_path, b"\xab\x01") == tmp_path / "ab" / "ab01.kvblock"


def test_every_stored_dtype_round_trips_bit_exact(stored):
    parts, stats = read_block(stored, identity=IDENTITY)
    assert list(parts) == list(PARTS)
    for name, tensor in PARTS.items():
        assert same_bits(parts[name], tensor), name
        assert parts[name].device.type == "cpu"
    assert stats.n_bytes == sum(t.numel() * t.element_size() for t in PARTS.values())


def test_parts_sit_at_aligned_offsets_after_a_padded_header(stored):
    text = stored.read_bytes()
    length = int.from_bytes(text[8:16], "little")
    header = json.loads(text[16 : 16 + length])
    assert all(part["offset"] % ALIGN == 0 for part in header["parts"])
    assert header["parts"][0]["offset"] >= 16 + length and stored.stat().st_size % ALIGN == 0


def test_o_direct_is_used_on_a_filesystem_that_allows_it(tmp_path):
    if not on_o_direct_filesystem(tmp_path):
        pytest.skip(f"{tmp_path} is on {block_file.filesystem_type(tmp_path)}, which refuses O_DIRECT")
    path = tmp_path / "b.kvblock"
    assert write_block(path, PARTS, identity=IDENTITY).direct_io
    _, stats = read_block(path, identity=IDENTITY)
    assert stats.direct_io and stats.cold


def test_the_buffered_path_round_trips_and_says_it_is_buffered(tmp_path):
    path = tmp_path / "b.kvblock"
    assert not write_block(path, PARTS, identity=IDENTITY, direct=False).direct_io
    parts, stats = read_block(path, identity=IDENTITY, direct=False)
    assert not stats.direct_io
    assert stats.cold == (block_file.filesystem_type(tmp_path) not in block_file.MEMORY_FILESYSTEMS)
    assert all(same_bits(parts[name], tensor) for name, tensor in PARTS.items())


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered(tmp_path, monkeypatch):
    real_open = os.open

    def tmpfs_like_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # EINVAL, as tmpfs answers O_DIRECT
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", tmpfs_like_open)
    path = tmp_path / "b.kvblock"
    assert not write_block(path, PARTS, identity=IDENTITY).direct_io
    parts, stats = read_block(path, identity=IDENTITY)
    assert not stats.direct_io and same_bits(parts["k"], PARTS["k"])


def test_a_flipped_payload_byte_is_a_checksum_mismatch(stored):
    data = bytearray(stored.read_bytes())
    header = json.loads(data[16 : 16 + int.from_bytes(data[8:16], "little")])
    data[header["parts"][1]["offset"] + 3] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(BlockRejected, match="payload checksum mismatch") as caught:
        read_block(stored, identity=IDENTITY)
    assert str(stored) in str(caught.value) and "\n" not in str(caught.value)


def test_another_identity_is_rejected_naming_the_field_and_both_values(stored):
    with pytest.raises(BlockRejected) as caught:
        read_block(stored, identity=IDENTITY | {"n_layers": 3})
    message = str(caught.value)
    assert str(stored) in message and "'n_layers'" in message and "stored 2" in message and "expected 3" in message
    assert caught.value.path == stored and "n_layers" in caught.value.reason


def test_an_identity_field_missing_from_the_file_is_rejected(stored):
    with pytest.raises(BlockRejected, match="'dtype' differs: stored None, expected 'bf16'"):
        read_block(stored, identity=IDENTITY | {"dtype": "bf16"})


def test_a_truncated_file_is_rejected(stored):
    stored.write_bytes(stored.read_bytes()[: 2 * ALIGN + 100])
    with pytest.raises(BlockRejected, match="truncated") as caught:
        read_block(stored, identity=IDENTITY)
    assert str(stored) in str(caught.value)


def test_a_file_cut_inside_its_header_is_rejected(stored):
    stored.write_bytes(stored.read_bytes()[:40])
    with pytest.raises(BlockRejected, match="truncated"):
        read_block(stored, identity=IDENTITY)


def test_a_garbage_header_is_rejected(stored):
    stored.write_bytes(os.urandom(3 * ALIGN))
    with pytest.raises(BlockRejected, match="unreadable header") as caught:
        read_block(stored, identity=IDENTITY)
    assert str(stored) in str(caught.value)


def rewrite_header(path, change) -> None:
    """Edit the header JSON in place (same length budget), keeping the payload."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + length])
    change(header)
    text = json.dumps(header).encode()
    data[8:16] = len(text).to_bytes(8, "little")
    data[16 : 16 + max(length, len(text))] = text.ljust(length, b"\0")
    path.write_bytes(bytes(data))


def test_a_header_edited_without_its_checksum_is_rejected(stored):
    rewrite_header(stored, lambda h: h["parts"][0].update(shape=[2, 1, 2, 8, 16]))  # same bytes, another shape
    with pytest.raises(BlockRejected, match="header checksum mismatch"):
        read_block(stored, identity=IDENTITY)


def test_a_part_whose_bytes_disagree_with_its_dtype_and_shape_is_rejected(stored):
    def wrong_dtype(header):
        header["parts"][0]["dtype"] = "float16"  # the header claims fp16 for 4-byte values
        header["header_crc32"] = block_file._header_checksum(header)

    rewrite_header(stored, wrong_dtype)
    with pytest.raises(BlockRejected, match="part 'k': 2048 bytes, but float16"):
        read_block(stored, identity=IDENTITY)


def test_another_format_version_is_rejected(stored):
    rewrite_header(stored, lambda h: h.update(version=99))
    with pytest.raises(BlockRejected, match="format version 99"):
        read_block(stored, identity=IDENTITY)


def test_a_missing_file_is_rejected(tmp_path):
    with pytest.raises(BlockRejected, match="missing"):
        read_block(tmp_path / "absent.kvblock", identity=IDENTITY)


def test_a_write_failing_midway_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    path = tmp_path / "b.kvblock"

    def failing_write(fd, data):
        os_write(fd, bytes(data[:ALIGN]))
        raise OSError(28, "No space left on device")

    os_write = os.write
    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        write_block(path, PARTS, identity=IDENTITY)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor the temp file


def test_a_failed_rewrite_keeps_the_old_block(stored, monkeypatch):
    def failing_replace(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    other = {name: torch.zeros_like(t) for name, t in PARTS.items()}
    with pytest.raises(OSError):
        write_block(stored, other, identity=IDENTITY)
    monkeypatch.undo()
    parts, _ = read_block(stored, identity=IDENTITY)
    assert same_bits(parts["k"], PARTS["k"]) and [p.name for p in stored.parent.iterdir()] == [stored.name]


def test_parts_on_another_device_or_non_contiguous_are_stored_as_their_values(tmp_path):
    path = tmp_path / "b.kvblock"
    strided = {"k": PARTS["k"].transpose(3, 4)}  # [2, 1, 2, 8, 16], not contiguous
    write_block(path, strided, identity=IDENTITY)
    parts, _ = read_block(path, identity=IDENTITY)
    assert same_bits(parts["k"], strided["k"].contiguous())
