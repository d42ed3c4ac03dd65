"""KV transfer time against bytes, for the step-cost profile (`pdserve profile --transfer`).

A real sender and receiver of the configured transport, in this process (the receiver polls
on its own thread, as in the decode worker): frames of the model's block size, xxh3 checksums
checked on arrival and every frame copied into a landing buffer, acknowledged to the sender. The
fit is time = fixed + bytes / rate over the measured sizes (least squares).
"""

from __future__ import annotations

import statistics
import threading
import time

DEFAULT_TOKENS = (64, 512, 2048, 8192)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """time = fixed + bytes / rate, least squares on relative error (a 1 MiB transfer's
    milliseconds count as much as a 128 MiB one's tenth of a second)."""
    w = [1.0 / (s * s) for _, s in points]
    sw = sum(w)
    mx = sum(wi * b for wi, (b, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * s for wi, (_, s) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (b - mx) ** 2 for wi, (b, _) in zip(w, points, strict=True))
    sxy = sum(wi * (b - mx) * (s - my) for wi, (b, s) in zip(w, points, strict=True))
    slope = max(sxy / sxx if sxx else 0.0, 1e-15)
    return max(my - slope * mx, 0.0), 1.0 / slope


def _receive_into(rx, dst, stop: threading.Event) -> threading.Thread:
    """The decode side: check each transfer's checksums, copy its frames into `dst`, acknowledge."""
    import numpy as np

    from transfer import verify

    def loop() -> None:
        while not stop.is_set():
            for item in rx.poll(0.01):
                try:
                    if item.error:
                        raise RuntimeError(item.error)
                    if not item.landed:
                        verify(item.header, item.frames)
                        off = 0
                        for buf in item.frames:
                            dst[off:off + buf.nbytes] = np.frombuffer(buf, dtype=np.uint8)
                            off += buf.nbytes
                    item.ack(True)
                except Exception as e:  # reported to the sender, which fails the measurement
                    item.ack(False, str(e))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _time_one_size(tx, address: str, src, n_tokens: int, block_size: int, block_nbytes: int, frame_blocks: int,
                   repeats: int) -> tuple[int, float]:
    """(bytes, median seconds) of sending one n_tokens prompt's KV, `repeats` times after a warm-up."""
    from transfer import build_header

    blocks = -(-n_tokens // block_size)
    per = [min(frame_blocks, blocks - i) for i in range(0, blocks, frame_blocks)]
    frames, off = [], 0
    for nb in per:
        frames.append(memoryview(src[off:off + nb * block_nbytes]))
        off += nb * block_nbytes
    times = []
    for r in range(repeats + 1):
        header = build_header(f"profile-{n_tokens}-{r}", "uint8", [block_nbytes], block_nbytes,
                              [None] * blocks, frames, per)
        t0 = time.perf_counter()
        handle = tx.send(address, header, frames, timeout_s=30.0)
        while not handle.done:
            tx.poll()
            time.sleep(0.0002)
        if handle.error:
            raise RuntimeError(f"profile transfer failed: {handle.error}")
        if r:  # the first one connects
            times.append(time.perf_counter() - t0)
    return off, statistics.median(times)


def measure_transfer(transport: str, kv_bytes_per_token: int, block_size: int, tokens: tuple[int, ...] = DEFAULT_TOKENS,
                     repeats: int = 5, frame_blocks: int = 64) -> dict:
    import numpy as np

    from transfer import make_receiver, make_sender

    block_nbytes = kv_bytes_per_token * block_size
    biggest = -(-max(tokens) // block_size)
    src = np.random.default_rng(0).integers(0, 255, biggest * block_nbytes, dtype=np.uint8)
    rx = make_receiver(transport, host="127.0.0.1")
    tx = make_sender(transport)
    stop = threading.Event()
    thread = _receive_into(rx, np.empty_like(src), stop)
    points, rows = [], []
    try:
        for n_tokens in tokens:
            nbytes, seconds = _time_one_size(tx, rx.address, src, n_tokens, block_size, block_nbytes, frame_blocks,
                                             repeats)
            points.append((nbytes, seconds))
            rows.append({"tokens": n_tokens, "bytes": nbytes, "seconds": seconds})
    finally:
        stop.set()
        thread.join()
        tx.close()
        rx.close()
    fixed, rate = _fit(points)
    return {"transport": transport, "fixed_s": fixed, "bytes_per_s": rate, "points": rows}
