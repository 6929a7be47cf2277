"""HELM Tokenizer over the engine's own tokenizer.

The window service (prompt truncation, language-modeling windows) and the metrics
tokenize through this class, and the client tokenizes prompts with the same object,
so HELM's token counts and the tokens the model sees are the same. Encoding never adds
special tokens (HELM adds its own prefix token where the tokenizer config says so).

No HELM cache: HELM's CachingTokenizer opens its sqlite file, looks the request up and
commits it at every call, ~3 ms, where this local tokenizer takes well under one (a
400-instance few-shot run tokenizes 800 times: 2.5 s of the cache against ~0.3 s of
tokenizing; runs/helm_vs_hf/NOTES.md). The tokens are the same either way: they depend
on the checkpoint's tokenizer alone.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from helm.common.cache import CacheConfig
from helm.common.tokenization_request import (
    DecodeRequest,
    DecodeRequestResult,
    TokenizationRequest,
    TokenizationRequestResult,
    TokenizationToken,
)
from helm.tokenizers.tokenizer import Tokenizer

from flexgen_helm.helm.engines import LoadArgs, get_tokenizer, resolve_load_args
from flexgen_helm.helm.tokens import helm_texts
from flexgen_helm.text import token_text_for


class FlexGenTokenizer(Tokenizer):
    def __init__(
        self,
        cache_config: CacheConfig,  # HELM hands every tokenizer one; unused (above)
        tokenizer_name: str,
        model: str,
        path: Optional[str] = None,
        dummy: bool = False,
        deployment: Optional[str] = None,
        policy: Any = None,
        offload_dir: Optional[str] = None,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
    ):
        self.tokenizer_name = tokenizer_name
        self.load_args: LoadArgs = resolve_load_args(
            model, deployment=deployment or tokenizer_name, path=path, dummy=dummy,
            policy=policy, offload_dir=offload_dir, device=device, dtype=dtype,
        )

    @property
    def hf_tokenizer(self):
        return get_tokenizer(self.load_args)

    def tokenize(self, request: TokenizationRequest) -> TokenizationRequestResult:
        start = time.time()
        try:
            tt = token_text_for(self.hf_tokenizer)
            ids = tt.encode(request.text)
            if request.truncation:
                ids = ids[: max(request.max_length, 0)]
            values = ids if request.encode else helm_texts(tt, ids)
        except Exception as error:
            raise ValueError(f"{self.tokenizer_name} could not tokenize {request.text[:80]!r}: {error}") from error
        return TokenizationRequestResult(success=True, cached=False, text=request.text,
                                         tokens=[TokenizationToken(v) for v in values],
                                         request_time=time.time() - start)

    def decode(self, request: DecodeRequest) -> DecodeRequestResult:
        start = time.time()
        try:
            text = token_text_for(self.hf_tokenizer).hf_decode(
                request.tokens, clean_up_tokenization_spaces=request.clean_up_tokenization_spaces)
        except Exception as error:
            raise ValueError(f"{self.tokenizer_name} could not decode {len(request.tokens)} tokens: {error}") from error
        return DecodeRequestResult(success=True, cached=False, text=text, request_time=time.time() - start)
