"""Unit tests of the tiny policy's tokenizer and checkpoints (engines/models/modeling.py), on a tiny char-level Qwen2 built in the test
(seconds on one CPU thread)."""

from __future__ import annotations

import pytest
import torch

from engines.models.modeling import (
    CHARSET,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    load_policy,
)
from tests.support.engines import PROMPTS, encode

torch.set_num_threads(1)


def test_tokenizer_round_trips_every_char():
    tok = build_char_tokenizer()
    ids = tok(CHARSET, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARSET)                     # one token per character
    assert len(set(ids)) == len(CHARSET)                # distinct characters, distinct tokens
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == CHARSET
    for ch in CHARSET:
        (i,) = tok(ch, add_special_tokens=False)["input_ids"]
        assert tok.decode([i]) == ch
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARSET)
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == CHARSET
    assert tok("A", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]  # not in the charset


def test_save_load_gives_identical_logits(tiny_policy, tiny_model_dir):
    model, tok = tiny_policy
    loaded, tok2 = load_policy(tiny_model_dir)
    assert tok2.padding_side == "left"
    assert tok2.pad_token_id == tok.pad_token_id and tok2.eos_token_id == tok.eos_token_id
    ids = torch.tensor([encode(tok, ["9-3+4-1=rev abc"])[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded.eval()(ids).logits)
    assert tok2.decode(ids[0].tolist()) == "9-3+4-1=rev abc"


def test_reloaded_tokenizer_encodes_like_the_original(tiny_model_dir):
    """BUG (engines/models/modeling.py, load_policy): for a Qwen2 config, transformers 5's AutoTokenizer
    ignores tokenizer_config's `TokenizersBackend` and builds a `Qwen2Tokenizer` (byte-level regex
    pre-tokenizer + NFC) around the char vocabulary, so every checkpoint round trip silently drops
    ' ' and '\n' from encoded text ("rev abc=" -> "revabc=")."""
    tok = build_char_tokenizer()
    _, tok2 = load_policy(tiny_model_dir)
    assert encode(tok2, [CHARSET, *PROMPTS, "a\nb c"]) == encode(tok, [CHARSET, *PROMPTS, "a\nb c"])


def test_load_policy_missing_dir_names_the_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_policy(missing)
