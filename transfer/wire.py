"""The KV wire format: a msgpack header, then raw frames (each a run of whole blocks).

The header names dtype, block shape and size, each block's hash and each frame's size and
xxh3-64 checksum. Bulk bytes never enter msgpack: they ride as separate zero-copy frames.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

WIRE_VERSION = 1
# A header names a few thousand blocks at most; anything bigger is not a header we sent.
MAX_HEADER_BYTES = 4 << 20
_UNPACK_LIMITS = dict(max_str_len=1 << 16, max_bin_len=0, max_ext_len=0,
                      max_array_len=1 << 20, max_map_len=1 << 10)


class TransferError(RuntimeError):
    """A transfer that failed or whose data did not pass its checks."""


@dataclass(slots=True)
class FrameInfo:
    num_blocks: int
    nbytes: int
    checksum: int


@dataclass(slots=True)
class KVHeader:
    request_id: str
    dtype: str
    block_shape: list[int]
    block_nbytes: int
    block_hashes: list[int | None]  # one per shipped block; None for a trailing partial block
    first_block: int = 0  # index in the sequence's block table of the first shipped block
    frames: list[FrameInfo] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # small per-request values (first token...)
    # Unique per attempt: a late acknowledgement of an earlier attempt never settles a retry.
    transfer_id: str = ""
    # Set by a transport that offers same-host memory (transfer/shared_memory.py): {"offer": the
    # region, "refs": whether this transfer's frames are references into it}.
    shared: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise TransferError("header lacks a request id")
        if self.block_nbytes <= 0 or any(d <= 0 for d in self.block_shape):
            raise TransferError(f"bad block geometry {self.block_shape} / {self.block_nbytes} bytes")

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.frames)

    def encode(self) -> bytes:
        return msgpack.packb({
            "v": WIRE_VERSION, "rid": self.request_id, "dtype": self.dtype, "shape": self.block_shape,
            "bnb": self.block_nbytes, "hashes": self.block_hashes, "first": self.first_block,
            "frames": [[f.num_blocks, f.nbytes, f.checksum] for f in self.frames], "meta": self.meta,
            "tid": self.transfer_id, **({"shm": self.shared} if self.shared else {}),
        })

    @classmethod
    def decode(cls, data: bytes | memoryview) -> KVHeader:
        if memoryview(data).nbytes > MAX_HEADER_BYTES:
            raise TransferError(f"KV header of {memoryview(data).nbytes} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            d = msgpack.unpackb(data, strict_map_key=False, **_UNPACK_LIMITS)
            if d.get("v") != WIRE_VERSION:
                raise TransferError(f"wire version {d.get('v')!r}, expected {WIRE_VERSION}")
            return cls(d["rid"], d["dtype"], list(d["shape"]), int(d["bnb"]), list(d["hashes"]), int(d["first"]),
                       [FrameInfo(*f) for f in d["frames"]], dict(d.get("meta") or {}), str(d.get("tid", "")),
                       dict(d.get("shm") or {}))
        except TransferError:
            raise
        except Exception as e:  # malformed msgpack or missing keys
            raise TransferError(f"malformed KV header: {e}") from e


# ---- authorization: a one-time key per reservation signs what lands in it ----------------------
# The decode worker learns the key with the reservation; the router gives it to the one prefill
# worker it chose. The header's tag covers the header bytes (geometry, hashes, request, attempt
# and, when filled up front, the frames' digests); each frame's tag covers the transfer id, the
# frame index and its xxh3 digest, so a sender may hash each frame just before it goes out. A
# receiver checks a tag before it lets anything of a transfer touch a reservation.
KeyLookup = Callable[[KVHeader], bytes]  # the reservation's key, or TransferError


def header_tag(key: bytes | None, header_bytes: bytes | memoryview) -> bytes:
    return hmac.new(key, b"pdkv-header\0" + bytes(header_bytes), hashlib.sha256).digest() if key else b""


def frame_tag(key: bytes | None, transfer_id: str, index: int, digest: int) -> bytes:
    if not key:
        return b""
    return hmac.new(key, b"pdkv-frame\0" + transfer_id.encode() + struct.pack("<IQ", index, digest),
                    hashlib.sha256).digest()


def check_tag(expected: bytes, got: bytes, what: str) -> None:
    if not hmac.compare_digest(expected, bytes(got)):
        raise TransferError(f"{what} is not signed with the reservation's transfer key (refused before landing)")


def authorize(keys: KeyLookup | None, header: KVHeader, header_bytes: bytes | memoryview, tag: bytes) -> bytes | None:
    """The reservation's key once the header's tag checks out (TransferError otherwise); None when
    the receiver checks nothing (no key lookup: unit tests, the security-off benchmark)."""
    if keys is None:
        return None
    key = keys(header)
    if not key:  # a reservation without a key is open to no one, not to everyone
        raise TransferError(f"{header.request_id}: the reservation has no transfer key")
    check_tag(header_tag(key, header_bytes), tag, f"{header.request_id}: KV header")
    return key


def checksum(buf: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def build_header(request_id: str, dtype: str, block_shape: Sequence[int], block_nbytes: int,
                 block_hashes: Sequence[int | None], frames: Sequence[memoryview], blocks_per_frame: Sequence[int],
                 first_block: int = 0, meta: dict[str, Any] | None = None, checksums: bool = True) -> KVHeader:
    """checksums=False leaves them to the transport, which may compute each one just before
    that frame goes out (so hashing overlaps the wire)."""
    infos = [FrameInfo(n, f.nbytes, checksum(f) if checksums else 0)
             for f, n in zip(frames, blocks_per_frame, strict=True)]
    return KVHeader(request_id, dtype, list(block_shape), block_nbytes, list(block_hashes), first_block, infos,
                    dict(meta or {}))


def fill_checksums(header: KVHeader, frames: Sequence[memoryview]) -> None:
    for info, f in zip(header.frames, frames, strict=True):
        if not info.checksum:
            info.checksum = checksum(f)


def verify_layout(header: KVHeader) -> None:
    if sum(f.num_blocks for f in header.frames) != header.num_blocks:
        raise TransferError(f"{header.request_id}: frames cover a different block count than the header")


def verify_frame(header: KVHeader, index: int, buf: memoryview | bytes, digest: int | None = None) -> None:
    """Size and xxh3 of one frame (against `digest`, or the header's checksum for it)."""
    verify_frame_size(header, index, memoryview(buf).nbytes)
    if checksum(buf) != (header.frames[index].checksum if digest is None else digest):
        raise TransferError(f"{header.request_id}: frame {index} fails its xxh3 checksum (corrupt data)")


def verify_frame_size(header: KVHeader, index: int, n: int) -> None:
    if not 0 <= index < len(header.frames):
        raise TransferError(f"{header.request_id}: frame index {index} outside the header's {len(header.frames)}")
    info = header.frames[index]
    if n != info.nbytes or n != info.num_blocks * header.block_nbytes:
        raise TransferError(f"{header.request_id}: frame {index} has {n} bytes, expected {info.nbytes} "
                            f"({info.num_blocks} blocks of {header.block_nbytes})")


def verify(header: KVHeader, frames: Sequence[memoryview | bytes]) -> None:
    """Structural and checksum checks of a complete transfer; raises TransferError naming the
    first problem."""
    if len(frames) != len(header.frames):
        raise TransferError(f"{header.request_id}: {len(frames)} frames received, header announces "
                            f"{len(header.frames)} (truncated message)")
    verify_layout(header)
    for i, buf in enumerate(frames):
        verify_frame(header, i, buf)
