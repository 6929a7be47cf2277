"""Stop strings: the one implementation, for the engine (to end generation early) and for
the frontends (to cut the completion)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexgen_helm.text.token_text import TokenText, clean_surrogates


@dataclass(frozen=True)
class StopCut:
    """A completion cut before its first stop string."""

    token_ids: list[int]  # the tokens that start before the cut (one may straddle it: tokens are atomic)
    text: str  # the text exactly up to the cut
    stopped: bool  # a stop string was found


@dataclass(frozen=True, eq=False)
class StopStrings:
    """Ends a sequence at the first of `strings` (an executor.sampling.StopCondition)."""

    token_text: TokenText
    strings: tuple[str, ...]

    def reached(self, token_ids: Sequence[int]) -> bool:
        return self.cut(token_ids).stopped

    def cut(self, token_ids: Sequence[int]) -> StopCut:
        """Drop the first stop string and everything after it.

        Works on bytes decoded with surrogateescape, which keeps offsets exact through a
        partial UTF-8 character at either end of a token."""
        ids = list(token_ids)
        parts = [self.token_text.token_bytes(t) for t in ids]
        text = b"".join(parts).decode("utf-8", errors="surrogateescape")
        cut = min((i for i in (text.find(s) for s in self.strings if s) if i >= 0), default=-1)
        if cut < 0:
            return StopCut(ids, clean_surrogates(text), False)
        cut_bytes = len(text[:cut].encode("utf-8", errors="surrogateescape"))
        kept, start = [], 0
        for t, b in zip(ids, parts):
            if start >= cut_bytes:
                break
            kept.append(t)
            start += len(b)
        return StopCut(kept, clean_surrogates(text[:cut]), True)
