"""KV between processes on one host without the wire.

A sender whose KV frames lie in memory it can share (a worker's KV pool allocated in a memfd,
see `KVSender.share`) offers that memory with each transfer's header. A receiver on the same
host maps it read-only, once, and then takes each frame as an (offset, length) reference into it:
it checks the frame's xxh3 and lands it from the sender's pool with one copy. Over a socket the
same bytes are copied into the kernel, out of it, and into a message buffer first; on the
2-core test host that made a 32 MiB transfer (a 2048-token prompt of the 50M model) take
20-60 ms on the path to the second token.

Same host means the same boot and a process the receiver can open by /proc/PID/fd/FD (the same
PID namespace and user, or root): the offer names the boot, process, descriptor and the memfd's
inode, and the receiver maps only what matches all of them, so a PID reused by an unrelated
process, or another host's numbers, are never mapped. Either side may be unable: the receiver
says so in its acknowledgement, and the sender keeps sending bytes to that peer.

The references carry no authority of their own: the header (offer and all) and each frame's
digest are signed with the transfer key as on the wire. The receiver lands each frame straight
from the sender's memory and then computes its checksum from that memory: bytes the sender
changed before or during the copy (blocks reused after a cancel or a timeout) fail it, and the
failed import is never committed. Frames by reference are cut to at most PIECE_BYTES, so that
the sender's hashing of one overlaps the receiver's landing of the one before, whatever
transfer.max_frame_bytes says. (Smaller pieces cost more than they gained: per 32 MiB, 1 MiB
pieces took 7.5-9.5 ms, 4 MiB ones 6.3-8.2 ms, mostly in messages.)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from transfer.wire import FrameInfo, KVHeader, TransferError

REF = struct.Struct("<QQ")  # a frame by reference: offset into the offered region, byte count
IDLE_MAP_S = 60.0  # a receiver unmaps a region no transfer used this long (its sender may be gone)
PIECE_BYTES = 4 << 20  # frames by reference are cut to this (at least one block)
MADV_POPULATE_READ = 22  # Linux 5.14: map a range's pages in, as reading them would, in one call
POPULATE_STEP = 64 << 20  # a mapping is populated this much per call (an unmap stops it in between)
_libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's madvise among them
_libc.madvise.argtypes, _libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = boot_id()


def flat(buf: memoryview) -> memoryview:
    """The buffer as one dimension of bytes."""
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def address_of(buf: memoryview) -> int | None:
    """The address of a buffer's first byte, or None when it cannot be taken (read-only or not
    contiguous: such a frame travels as bytes)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer, _release_buffer = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
_get_buffer.argtypes, _get_buffer.restype = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int], ctypes.c_int
_release_buffer.argtypes, _release_buffer.restype = [ctypes.POINTER(_PyBuffer)], None


def readonly_address(obj: object) -> int:
    """The address of a buffer's first byte, read-only ones too (address_of needs a writable
    buffer). Valid while the caller holds an export of the buffer (a memoryview of it)."""
    buf = _PyBuffer()
    if _get_buffer(obj, ctypes.byref(buf), 0) != 0:  # PyBUF_SIMPLE
        raise BufferError("no buffer")
    try:
        return buf.buf
    finally:
        _release_buffer(ctypes.byref(buf))


def populate(mm: mmap.mmap, size: int, stop: threading.Event) -> None:
    """Map a mapping's pages in (MADV_POPULATE_READ), a step at a time; ctypes lets go of the GIL
    for each call. Stops at `stop`, or where the kernel lacks the advice (older than 5.14). The
    view it holds meanwhile keeps the mapping from being closed under it (mmap.close raises
    BufferError, and RegionMaps tries again later)."""
    try:
        view = memoryview(mm)
    except ValueError:  # unmapped already
        return
    try:
        base = readonly_address(view)
        for off in range(0, size, POPULATE_STEP):
            if stop.is_set() or _libc.madvise(base + off, min(POPULATE_STEP, size - off), MADV_POPULATE_READ):
                return
    finally:
        view.release()


@dataclass
class SharedRegion:
    """Sender side: memory behind a descriptor other processes may map (a memfd)."""

    fd: int
    base: int
    nbytes: int
    view: memoryview  # keeps the memory alive and mapped while the region is offered
    offer: dict  # what a receiver needs to find and check it (sent with every transfer's header)

    @classmethod
    def of(cls, fd: int, view: memoryview) -> SharedRegion | None:
        view = flat(view)
        base = address_of(view)
        st = os.fstat(fd)
        if base is None or not BOOT_ID or st.st_size < view.nbytes:
            return None
        offer = {"boot": BOOT_ID, "pid": os.getpid(), "fd": fd, "dev": st.st_dev, "ino": st.st_ino,
                 "size": view.nbytes}
        return cls(fd, base, view.nbytes, view, offer)

    def ref(self, frame: memoryview) -> bytes | None:
        """The frame as a reference into this region, or None when it lies outside it."""
        if frame.nbytes == 0:
            return None
        addr = address_of(flat(frame))
        if addr is None or not self.base <= addr or addr + frame.nbytes > self.base + self.nbytes:
            return None
        return REF.pack(addr - self.base, frame.nbytes)


def cut_frames(header: KVHeader, frames: list[memoryview], piece_bytes: int = PIECE_BYTES) -> list[memoryview]:
    """The frames cut into pieces of whole blocks, at most `piece_bytes` each (at least one
    block); the header's frame list is rewritten to match (checksums left to the sender)."""
    per = max(1, piece_bytes // header.block_nbytes)
    infos, pieces = [], []
    for info, frame in zip(header.frames, frames, strict=True):
        whole = flat(frame)
        for b in range(0, info.num_blocks, per):
            n = min(per, info.num_blocks - b)
            pieces.append(whole[b * header.block_nbytes:(b + n) * header.block_nbytes])
            infos.append(FrameInfo(n, n * header.block_nbytes, 0))
    header.frames = infos
    return pieces


def offer_key(offer: dict) -> tuple:
    return (offer.get("boot"), offer.get("pid"), offer.get("dev"), offer.get("ino"))


@dataclass
class _Mapped:
    mm: mmap.mmap
    view: memoryview
    used: float
    stop: threading.Event = field(default_factory=threading.Event)  # ends its populating thread


class RegionMaps:
    """Receiver side: the regions mapped so far, by their offer's identity."""

    def __init__(self, enabled: bool = True, idle_s: float = IDLE_MAP_S) -> None:
        self.enabled = enabled and bool(BOOT_ID)
        self.idle_s = idle_s
        self._maps: dict[tuple, _Mapped] = {}
        self._refused: set[tuple] = set()  # offers that could not be mapped: not tried again

    def map(self, offer: dict) -> bool:
        """Whether the offered region is (now) mapped here."""
        key = offer_key(offer)
        if key in self._maps:
            self._maps[key].used = time.monotonic()
            return True
        if not self.enabled or key in self._refused or offer.get("boot") != BOOT_ID:
            return False
        try:
            path = f"/proc/{int(offer['pid'])}/fd/{int(offer['fd'])}"
            if not os.readlink(path).startswith("/memfd:"):  # only a memfd is offered, never a file
                self._refused.add(key)
                return False
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, KeyError, TypeError, ValueError):
            self._refused.add(key)
            return False
        try:
            st = os.fstat(fd)
            size = int(offer["size"])
            if (st.st_dev, st.st_ino) != (offer.get("dev"), offer.get("ino")) or not 0 < size <= st.st_size:
                self._refused.add(key)  # another process's descriptor under a reused PID
                return False
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError, TypeError):
            self._refused.add(key)
            return False
        finally:
            os.close(fd)
        entry = self._maps[key] = _Mapped(mm, memoryview(mm), time.monotonic())
        # Each page of a fresh mapping faults in the first time it is read. Landing a 2048-token
        # prompt's 32 MiB from pages read for the first time took 5.8 ms instead of 3.2. The
        # pages are mapped in on a thread of their own (populated here, a pool of tens of GiB
        # would hold up the first transfer for seconds); transfers meanwhile fault in what they
        # read, as before.
        threading.Thread(target=populate, args=(mm, size, entry.stop), name="kv-map-populate", daemon=True).start()
        return True

    def frame(self, offer: dict, ref: bytes | memoryview) -> memoryview:
        """The bytes a reference names (TransferError when it does not fit the region)."""
        entry = self._maps.get(offer_key(offer))
        if entry is None:
            raise TransferError("KV frame by reference into a region this receiver has not mapped")
        if memoryview(ref).nbytes != REF.size:
            raise TransferError("malformed KV frame reference")
        off, n = REF.unpack(ref)
        view = entry.view
        if off + n > view.nbytes:
            raise TransferError(f"KV frame reference [{off}, {off + n}) outside the {view.nbytes}-byte region")
        return view[off:off + n]

    def expire(self, busy: set[tuple] = frozenset()) -> None:
        now = time.monotonic()
        for key, entry in list(self._maps.items()):
            if key not in busy and now - entry.used > self.idle_s:
                self._unmap(key)

    def _unmap(self, key: tuple) -> None:
        entry = self._maps.pop(key)
        entry.stop.set()
        entry.view.release()
        try:
            entry.mm.close()
        except BufferError:  # a frame view still out (a transfer being landed, or populating): next time
            self._maps[key] = _Mapped(entry.mm, memoryview(entry.mm), time.monotonic(), entry.stop)

    @property
    def num_mapped(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for key in list(self._maps):
            self._unmap(key)
        self._maps.clear()
