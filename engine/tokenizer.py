"""A model's tokenizer straight from tokenizer.json through the `tokenizers` library.

Importing transformers takes ~1.4 s (its lazy module table alone walks the whole package), and
every process that tokenizes (the router, each worker) paid it at start-up: about a seventh of
`pdserve up` on stories260K. The serving path needs four things from a tokenizer: encode, decode,
token strings and the EOS id; the Rust tokenizer does each exactly as transformers' fast
tokenizer does (which wraps the same object). Everything else (chat templates first of all)
goes to transformers' own tokenizer, loaded on first use, so its behaviour is transformers'.

Only folders whose tokenizer_config.json asks for nothing transformers would change in the
Rust tokenizer take this path (`load_fast`); the others load transformers' tokenizer as before."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Settings with which transformers may rewrite the Rust tokenizer's pipeline (post-processor,
# pre-tokenizer) when it loads one: a folder that sets any of them keeps transformers' tokenizer.
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "model_input_names")
# Tokens transformers adds to the Rust tokenizer's table if it lacks them: fine when it has them all.
_LISTED_TOKENS = ("additional_special_tokens", "extra_special_tokens")
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(slots=True)
class Encoding:
    input_ids: list[int]


def _content(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok if isinstance(tok, str) else None


def _read_config(path: Path) -> dict[str, Any]:
    f = path / "tokenizer_config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def fast_path_ok(tok: Any, cfg: dict[str, Any]) -> bool:
    """Whether the Rust tokenizer `tok` alone serves the folder whose tokenizer_config.json is
    `cfg`: the config sets nothing that rewrites its pipeline, and every special or added token it
    names is already in its table (same id where the config gives one)."""
    if any(cfg.get(k) is not None for k in _REWRITING_KEYS):
        return False
    added = {t.content: (i, t.special) for i, t in tok.get_added_tokens_decoder().items()}
    for i, t in (cfg.get("added_tokens_decoder") or {}).items():
        if not isinstance(t, dict) or added.get(_content(t)) != (int(i), bool(t.get("special"))):
            return False
    named = [_content(cfg.get(k)) for k in _NAMED_TOKENS]
    for k in _LISTED_TOKENS:
        v = cfg.get(k) or []
        named += [_content(t) for t in (v.values() if isinstance(v, dict) else v)]
    return all(t is None or added.get(t, (0, False))[1] for t in named)


def load_fast(path: Path) -> FastTokenizer | None:
    """The folder's tokenizer without transformers, or None where it needs transformers'."""
    if not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok, cfg = Tokenizer.from_file(str(path / "tokenizer.json")), _read_config(path)
    return FastTokenizer(path, tok, cfg) if fast_path_ok(tok, cfg) else None


class FastTokenizer:
    """The subset of transformers' tokenizer API the engine and router call, from `tokenizers`;
    any other attribute comes from transformers' tokenizer for the same folder (loaded once)."""

    def __init__(self, path: Path, tok: Any, cfg: dict[str, Any]) -> None:
        self.path = path
        self._tok = tok
        # transformers' tokenizer(text) turns off any truncation or padding the file configures.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._cfg = cfg
        template = path / "chat_template.jinja"
        self.chat_template: str | None = self._cfg.get("chat_template") or (
            template.read_text() if template.is_file() else None)
        self.eos_token_id = self._special_id("eos_token")
        self.bos_token_id = self._special_id("bos_token")
        self._hf_lock = threading.Lock()
        self._hf_tok: Any = None

    def _special_id(self, name: str) -> int | None:
        tok = _content(self._cfg.get(name))
        return self._tok.token_to_id(tok) if tok is not None else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if clean_up_tokenization_spaces is None:  # as transformers: the folder's setting, else off
            clean_up_tokenization_spaces = bool(self._cfg.get("clean_up_tokenization_spaces", False))
        if clean_up_tokenization_spaces:  # transformers' own text clean-up: its code, not a copy
            return self._hf().decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=True)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _hf(self) -> Any:
        with self._hf_lock:
            if self._hf_tok is None:
                from transformers import PreTrainedTokenizerFast

                self._hf_tok = PreTrainedTokenizerFast.from_pretrained(self.path)
            return self._hf_tok

    def __getattr__(self, name: str) -> Any:
        # Only names not found above reach here (apply_chat_template, special_tokens_map, ...).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._hf(), name)
