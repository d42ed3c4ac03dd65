"""The last decoder layer runs only the rows that sample (DecoderModel.forward's `keep`).

Every earlier layer computes every token (the next layer's K and V come from it), and the last
layer still writes every token's K and V; its attention, o_proj and MLP are for the sampled rows
alone. That the tokens stay the same is what the transformers comparisons in
test_engine_generation.py check (chunked prefill, prefix hits, every family); here, that the rows
are really skipped."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams


def _count_mlp_rows(eng: LLMEngine) -> dict[str, list[int]]:
    """Rows into the first and the last layer's down projection, one entry per call."""
    layers = eng.runner.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.down_proj.register_forward_pre_hook(lambda _m, args, name=name: rows[name].append(args[0].shape[0]))
    return rows


def test_last_layer_computes_only_the_rows_that_sample(stories_path):
    eng = LLMEngine(EngineConfig(model=stories_path, prefill_chunk_size=32, max_num_batched_tokens=256))
    rows = _count_mlp_rows(eng)
    params = SamplingParams(max_tokens=3, temperature=0)
    eng.add_request("long", list(range(3, 83)), params)  # 80 tokens: chunks of 32, 32 and 16
    eng.add_request("short", list(range(100, 120)), params)  # 20 tokens: done in the first step
    steps = []
    while eng.has_unfinished():
        n_first, n_last = len(rows["first"]), len(rows["last"])
        sampled = sum(1 for out in eng.step() if out.new_token_ids)
        steps.append((rows["first"][n_first], rows["last"][n_last:], sampled))
    # First step: 32 + 20 prompt tokens through every layer; the last layer's MLP sees the one
    # row that samples (the short prompt's last token).
    assert steps[0] == (52, [1], 1)
    for first, last, sampled in steps:
        assert last == ([sampled] if sampled else []), steps
        assert first >= sampled
    assert any(first > sampled for first, _, sampled in steps[1:]), "no later step mixed a prompt chunk in"


def test_a_chunk_that_samples_nothing_skips_the_last_layer(stories_path):
    """A prompt's earlier chunk samples no token: the last layer writes its K and V and stops."""
    eng = LLMEngine(EngineConfig(model=stories_path, prefill_chunk_size=32, max_num_batched_tokens=32))
    rows = _count_mlp_rows(eng)
    prompt, params = list(range(3, 83)), SamplingParams(max_tokens=4, temperature=0)
    eng.add_request("a", prompt, params)
    assert not any(out.new_token_ids for out in eng.step())
    assert rows == {"first": [32], "last": []}
    got = []
    while eng.has_unfinished():
        got += [t for out in eng.step() for t in out.new_token_ids]
    # The chunks' K and V were written all the same: the tokens are those of the prompt in one step.
    whole = LLMEngine(EngineConfig(model=stories_path, max_num_batched_tokens=256)).generate([prompt], params)
    assert got == whole[0]["token_ids"]
