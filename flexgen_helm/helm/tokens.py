"""Token ids -> the token strings HELM expects.

HELM's metrics count bytes and rebuild text from `Token.text`. A token that is not
valid UTF-8 on its own (half of a multi-byte character, as byte-level BPE produces)
is written the way HELM's OpenAI-style clients do: "bytes:" followed by every byte of
the token as a literal "\\xNN" escape; `helm.benchmark.metrics.basic_metrics`
(get_num_bytes, convert_tokens_to_text) counts and re-joins exactly that form.
Other tokens are their decoded text, so joining them gives the decoded sequence.

One `TokenText` is built per tokenizer and shared by the HELM tokenizer and the
client, so the strings of a prompt and of a generation always agree.
"""

from __future__ import annotations

import json
import re
import threading
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


class TokenText:
    """Bytes and HELM strings of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): getattr(t, "content", str(t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}
        self._lock = threading.Lock()
        # Hugging Face fast tokenizers are thread-hostile ("Already borrowed", HELM #1421):
        # every encode / decode of this tokenizer goes through this lock.
        self.call_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self.call_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

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

    def helm_text(self, token_id: int) -> str:
        b = self.token_bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def helm_texts(self, token_ids) -> list[str]:
        return [self.helm_text(t) for t in token_ids]

    def decode(self, token_ids) -> str:
        """The text of a token sequence, consistent with `helm_texts` (bad bytes -> U+FFFD)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def cut_at_stop(self, token_ids, stop_strings) -> tuple[list[int], str, bool]:
        """Drop the first stop string and everything after it.

        Returns (kept token ids, text, stopped). The text is cut exactly before the stop
        string; tokens are kept while they start before the cut, so a token that straddles
        the cut stays (tokens are atomic). Works on bytes with surrogateescape, which keeps
        offsets exact through partial UTF-8.
        """
        ids = list(token_ids)
        parts = [self.token_bytes(t) for t in ids]
        text = b"".join(parts).decode("utf-8", errors="surrogateescape")
        cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=-1)
        if cut < 0:
            return ids, clean_surrogates(text), False
        cut_bytes = len(text[:cut].encode("utf-8", errors="surrogateescape"))
        kept, start = [], 0
        for t, b in zip(ids, parts):
            if start >= cut_bytes:
                break
            kept.append(t)
            start += len(b)
        return kept, clean_surrogates(text[:cut]), True


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
