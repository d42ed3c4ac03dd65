"""Decode pool: receives KV blocks, runs continuous-batching decode, streams tokens."""

from decode_worker.main import serve
from decode_worker.service import DecodeService

__all__ = ["DecodeService", "serve"]
