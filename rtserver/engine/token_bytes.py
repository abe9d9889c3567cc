"""llguidance's view of a Hugging Face tokenizer, built from each token's bytes.

llguidance's own `from_tokenizer` parses a second copy of tokenizer.json, and a 262k-token
vocabulary's merges cost hundreds of MB there. Here llguidance gets the bytes of every token and a
callback into the one tokenizer the engine already holds.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

if TYPE_CHECKING:
    from llguidance import LLTokenizer

_TAG = re.compile(r"<[^<>]*>")


class UnsupportedDecoder(ValueError):
    """A tokenizer whose decoder maps tokens to bytes in a way not read here."""


def token_bytes(backend: Any) -> tuple[list[bytes], list[int]]:
    """The bytes of every token id of a `tokenizers.Tokenizer`, and the ids llguidance keeps out of
    text, as its own conversion picks them: special added tokens, added tokens written like a tag
    (`<td>`), and the byte 0xFF, its mark of a special token."""
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    added_text = {t.content for t in added.values()}
    special = {i for i, t in added.items() if t.special or _TAG.fullmatch(t.content)}
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    tokens = [b""] * (max(vocab.values()) + 1)
    if "ByteLevel" in kinds:  # GPT-2's bytes as printable characters
        gpt2: dict[int, str] = bytes_to_unicode()
        table = {c: b for b, c in gpt2.items()}
        for text, i in vocab.items():
            tokens[i] = text.encode() if text in added_text else bytes(table[c] for c in text)
    elif "ByteFallback" in kinds:  # SentencePiece: "▁" is a space, "<0xNN>" one byte
        for text, i in vocab.items():
            if text not in added_text and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                tokens[i] = bytes([int(text[3:5], 16)])
            else:
                tokens[i] = text.encode() if text in added_text else text.replace("\u2581", " ").encode()
    else:
        raise UnsupportedDecoder(f"token bytes of a tokenizer with decoder {sorted(map(str, kinds))}")
    special.update(i for i, b in enumerate(tokens) if b == b"\xff")
    return tokens, sorted(special)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, and str -> ids."""

    def __init__(self, hf: Any):
        self._backend = hf.backend_tokenizer
        self.tokens, self.special_token_ids = token_bytes(self._backend)
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then passes str
            raise TypeError("text must be str")
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids


def ll_tokenizer(hf: Any, n_vocab: int, eos_ids: list[int]) -> LLTokenizer:
    """An llguidance `LLTokenizer` for a fast Hugging Face tokenizer; one whose decoder is not read
    here gets llguidance's own conversion."""
    import llguidance.hf
    from llguidance import LLTokenizer
    from llguidance._tokenizer import TokenizerWrapper

    try:
        vocabulary = _Vocabulary(hf)
    except UnsupportedDecoder:
        return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos_ids or None)
    return LLTokenizer(TokenizerWrapper(vocabulary), n_vocab=n_vocab, eos_token=eos_ids or None)
