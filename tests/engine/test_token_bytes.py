"""llguidance's view of a tokenizer built from its tokens' bytes (engine/token_bytes.py) equals the one
llguidance builds from tokenizer.json: every token's bytes, which tokens it keeps out of text, and
the tokenization of text, for a byte-level BPE vocabulary and Gemma 3's SentencePiece one."""

from __future__ import annotations

from pathlib import Path

import llguidance.hf
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from rtbench.model_files import gemma3_270m
from rtserver.engine.model import _gguf_config, gguf_tokenizer
from rtserver.engine.token_bytes import UnsupportedDecoder, ll_tokenizer, token_bytes

TEXTS = ["Hello world, ça va? 你好 🙂", ' {"name": "Ada", "age": 36}\n\n', "<td>not a tag</td> <0xFF>"]


def assert_same_view(hf) -> None:
    vocab = len(hf)
    eos = [hf.eos_token_id]
    mine = ll_tokenizer(hf, vocab, eos)
    own = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    assert mine.vocab_size == own.vocab_size == vocab
    differ = [i for i in range(vocab) if mine.decode_bytes([i]) != own.decode_bytes([i])]
    assert differ == []
    assert [i for i in range(vocab) if mine.is_special_token(i) != own.is_special_token(i)] == []
    for text in TEXTS:
        assert mine.tokenize_str(text) == own.tokenize_str(text)


def test_a_byte_level_vocabulary_matches_llguidances_own(smol):
    assert_same_view(smol.tokenizer)


def test_gemma_3s_vocabulary_matches_llguidances_own():
    """262,144 tokens: "▁" spaces, byte-fallback tokens, thousands of added tokens."""
    path = gemma3_270m()
    assert_same_view(gguf_tokenizer(path, Path("~/.cache/rtserver").expanduser(), _gguf_config(path)))


def test_a_decoder_it_cannot_read_gets_llguidances_own_conversion():
    """WordPiece: refused by name here, then handed to llguidance, which refuses it in its own words."""
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[SEP]": 1, "a": 2, "##b": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(UnsupportedDecoder, match="WordPiece"):
        token_bytes(tok)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]")
    with pytest.raises(ValueError, match="can't determine decoder type"):
        ll_tokenizer(hf, len(hf), [hf.eos_token_id])
