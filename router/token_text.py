"""Token ids as the text users see, for logprobs (OpenAI and vLLM return ' there', not the
SentencePiece piece '▁there' or the byte-level 'Ġthere')."""

from __future__ import annotations

SP_SPACE = "\u2581"  # SentencePiece's word-boundary marker


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own. A SentencePiece decoder strips the leading space of a lone
    token's text; the piece still says the space is there, so it is put back."""
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for tid, piece in zip(ids, pieces, strict=True):
        text = tokenizer.decode([tid])
        if isinstance(piece, str) and piece.startswith(SP_SPACE) and not text.startswith(" "):
            text = " " + text
        out.append(text)
    return out


def text_offsets(texts: list[str], start: int) -> tuple[list[int], int]:
    """Character offset of each token in the completion text, and the offset after the last."""
    offsets = []
    for t in texts:
        offsets.append(start)
        start += len(t)
    return offsets, start
