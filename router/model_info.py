"""What the router knows of the model: tokenizer, context length, vocabulary. No weights."""

from __future__ import annotations

from dataclasses import dataclass

from engine.loader import _read_json, eos_ids, load_tokenizer, model_spec, resolve_model_path


@dataclass(slots=True)
class ModelInfo:
    path: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    name: str

    @classmethod
    def load(cls, model: str, max_model_len: int | None = None) -> ModelInfo:
        path = resolve_model_path(model)
        cfg = _read_json(path / "config.json")
        spec = model_spec(cfg, path)
        tok = load_tokenizer(path)
        limit = min(max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        return cls(str(path), tok, spec.vocab_size, limit, eos_ids(path, cfg, tok), path.name)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)
