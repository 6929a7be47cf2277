"""Token ids <-> bytes and text, for one tokenizer.

Text is built from the bytes of each token (byte-level BPE pieces mapped back to bytes,
SentencePiece byte fallback, added tokens as their content), so that a sequence's text is
exactly the concatenation of its tokens' bytes and offsets into it map back to tokens.
One `TokenText` is built per tokenizer and shared (`token_text_for`), so the HELM
tokenizer, the HELM client and the other frontends always agree.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-ins for the 256 byte values, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


# what TokenText.encode remembers: a few-shot scenario's prompts many times over
ENCODED_CHARS = 1 << 24


class TokenText:
    """Bytes and text of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): getattr(t, "content", str(t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}
        self._lock = threading.Lock()
        # Hugging Face fast tokenizers are thread-hostile ("Already borrowed", HELM #1421):
        # every encode / decode of this tokenizer goes through this lock.
        self.call_lock = threading.Lock()
        self._starts_with_bos: bool | None = None
        # the last texts encoded, up to ENCODED_CHARS characters: HELM's window service encodes
        # each prompt to check that it fits, then the client encodes the same text
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        """The tokens of `text` alone (no BOS or other special tokens)."""
        with self.call_lock:
            ids = self._encoded.get(text)
            if ids is None:
                ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                self._encoded_chars += len(text)
                while self._encoded_chars > ENCODED_CHARS:
                    self._encoded_chars -= len(self._encoded.popitem(last=False)[0])
            else:
                self._encoded.move_to_end(text)
            return list(ids)

    def encode_prompt(self, text: str) -> list[int]:
        """The tokenizer's default encoding: with the BOS the model was trained with, if any."""
        with self.call_lock:
            return list(self.tokenizer(text)["input_ids"])

    def starts_with_bos(self) -> bool:
        """Whether the tokenizer's default encoding starts with a BOS (as the model was trained)."""
        if self._starts_with_bos is None:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            ids = self.encode_prompt("a")
            self._starts_with_bos = bos is not None and len(ids) > 0 and ids[0] == bos
        return self._starts_with_bos

    def hf_decode(self, token_ids, clean_up_tokenization_spaces: bool = False) -> str:
        with self.call_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=False,
                                         clean_up_tokenization_spaces=clean_up_tokenization_spaces)

    def token_bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._compute_bytes(int(token_id))
            with self._lock:
                self._cache[token_id] = b
        return b

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            dec = _byte_decoder()
            if all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
            return piece.encode("utf-8")
        m = _HEX_BYTE.match(piece)  # SentencePiece byte fallback, e.g. <0xE2>
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode(self, token_ids) -> str:
        """The text of a token sequence (bytes that are not valid UTF-8 -> U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


def clean_surrogates(text: str) -> str:
    """Turn the lone surrogates of a surrogateescape decode into U+FFFD."""
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")


_TEXTS: dict[int, TokenText] = {}
_TEXTS_LOCK = threading.Lock()


def token_text_for(tokenizer) -> TokenText:
    """The shared TokenText of a tokenizer object."""
    with _TEXTS_LOCK:
        tt = _TEXTS.get(id(tokenizer))
        if tt is None or tt.tokenizer is not tokenizer:
            tt = _TEXTS[id(tokenizer)] = TokenText(tokenizer)
        return tt
