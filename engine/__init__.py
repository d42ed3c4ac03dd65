"""The compute core: model loading, paged KV cache, prefix caching, batching, sampling.

Names are re-exported lazily, so `import engine.config` or `engine.model_meta` (what the router
uses) never pulls in torch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "ModelLoadError": "engine.model_meta",
    "ModelInfo": "engine.model_meta",
    "KVLayout": "engine.model_meta",
    "EngineStats": "engine.outputs",
    "KVExport": "engine.outputs",
    "KVReservation": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "InvalidRequestError": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
}
__all__ = ["EngineConfig", "EngineStats", "InvalidRequestError", "KVExport", "KVLayout", "KVReservation", "LLMEngine",
           "ModelInfo", "ModelLoadError", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_meta import KVLayout, ModelInfo, ModelLoadError
    from engine.outputs import EngineStats, KVExport, KVReservation, RequestOutput
    from engine.sampling_params import InvalidRequestError, SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
