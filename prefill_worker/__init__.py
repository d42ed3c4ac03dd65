"""Prefill pool: builds the KV cache and first token, ships KV blocks to decode workers."""

from prefill_worker.main import serve
from prefill_worker.service import PrefillService

__all__ = ["PrefillService", "serve"]
