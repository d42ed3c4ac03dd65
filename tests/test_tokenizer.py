"""The tokenizer served without transformers (engine/tokenizer.py) against transformers' own, and
the folders that must keep transformers'."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from engine.model_meta import load_tokenizer
from engine.tokenizer import FastTokenizer

TEXTS = ["Once upon a time, there was a little girl named Lily.", "", " leading space", "two\n\nlines  and  gaps",
         "<s> markers </s> inside text <unk>", "Lily saw é, ü, 世界 and 😀 in the park."]


def _copy(src: str, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    f = dst / "tokenizer_config.json"
    f.chmod(0o644)
    f.write_text(json.dumps({**json.loads(f.read_text()), **config}))
    return dst


def test_fast_tokenizer_matches_transformers(stories_path):
    fast, hf = load_tokenizer(Path(stories_path)), PreTrainedTokenizerFast.from_pretrained(stories_path)
    assert isinstance(fast, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert fast(text, add_special_tokens=special).input_ids == hf(text, add_special_tokens=special).input_ids
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == \
                hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert fast.decode(ids[:1]) == hf.decode(ids[:1])
        assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert (fast.eos_token_id, fast.bos_token_id, len(fast)) == (hf.eos_token_id, hf.bos_token_id, len(hf))
    ids = [5, 6, 7]
    assert fast.decode(ids, clean_up_tokenization_spaces=True) == hf.decode(ids, clean_up_tokenization_spaces=True)


def test_the_folders_clean_up_setting_applies_by_default(stories_path, tmp_path):
    # (transformers ignores the setting for BPE tokenizers such as this one unless told twice)
    path = _copy(stories_path, tmp_path / "m", clean_up_tokenization_spaces=True,
                 clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    fast, hf = load_tokenizer(path), PreTrainedTokenizerFast.from_pretrained(path)
    ids = fast("Hello , world ! It 's a test .", add_special_tokens=False).input_ids
    assert isinstance(fast, FastTokenizer)
    assert fast.decode(ids) == hf.decode(ids) != fast.decode(ids, clean_up_tokenization_spaces=False)


def test_other_features_come_from_transformers(chat_model):
    fast, hf = load_tokenizer(Path(chat_model)), PreTrainedTokenizerFast.from_pretrained(chat_model)
    assert isinstance(fast, FastTokenizer) and fast.chat_template == hf.chat_template
    messages = [{"role": "user", "content": "hello"}]
    assert fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert fast.special_tokens_map == hf.special_tokens_map


@pytest.mark.parametrize("config", [
    {"add_bos_token": False},  # transformers may rebuild the post-processor from it
    {"added_tokens_decoder": {"600": {"content": "<extra>", "special": True}}},  # not in tokenizer.json
    {"pad_token": "<pad>"},  # a special token tokenizer.json lacks: transformers would add it
])
def test_configs_transformers_would_change_keep_its_tokenizer(stories_path, tmp_path, config):
    tok = load_tokenizer(_copy(stories_path, tmp_path / "m", **config))
    assert not isinstance(tok, FastTokenizer)


def test_the_router_loads_a_model_without_transformers(stories_path):
    code = ("import sys; from engine.model_meta import ModelInfo; m = ModelInfo.load(sys.argv[1]); "
            "assert m.encode('Once upon a time') and m.eos_token_ids; "
            "print(sorted(k for k in ('transformers', 'torch') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, stories_path], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
