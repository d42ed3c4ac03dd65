"""The compute core: model loading, paged KV cache, prefix caching, batching, sampling."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import ModelLoadError
from engine.outputs import EngineStats, KVExport, KVReservation, RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["EngineConfig", "EngineStats", "InvalidRequestError", "KVExport", "KVReservation", "LLMEngine",
           "ModelLoadError", "RequestOutput", "SamplingParams"]
