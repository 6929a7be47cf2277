"""HELM Tokenizer over the engine's own tokenizer.

The window service (prompt truncation, language-modeling windows) and the metrics
tokenize through this class, and the client tokenizes prompts with the same object,
so HELM's token counts and the tokens the model sees are the same. Encoding never adds
special tokens (HELM adds its own prefix token where the tokenizer config says so).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from helm.common.cache import CacheConfig
from helm.tokenizers.caching_tokenizer import CachingTokenizer

from flexgen_helm.helm.engines import LoadArgs, get_tokenizer, resolve_load_args
from flexgen_helm.helm.tokens import helm_texts
from flexgen_helm.text import token_text_for


class FlexGenTokenizer(CachingTokenizer):
    def __init__(
        self,
        cache_config: CacheConfig,
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
        super().__init__(cache_config=cache_config)
        self.tokenizer_name = tokenizer_name
        self.load_args: LoadArgs = resolve_load_args(
            model, deployment=deployment or tokenizer_name, path=path, dummy=dummy,
            policy=policy, offload_dir=offload_dir, device=device, dtype=dtype,
        )

    @property
    def hf_tokenizer(self):
        return get_tokenizer(self.load_args)

    def _key(self, request) -> Dict[str, Any]:
        # The checkpoint, not just the HELM name, identifies the vocabulary.
        key = super()._tokenization_request_to_cache_key(request)
        key["checkpoint"] = {"model": self.load_args.model, "path": self.load_args.path}
        return key

    def _tokenization_request_to_cache_key(self, request) -> Dict[str, Any]:
        return self._key(request)

    def _decode_request_to_cache_key(self, request) -> Dict[str, Any]:
        key = super()._decode_request_to_cache_key(request)
        key["checkpoint"] = {"model": self.load_args.model, "path": self.load_args.path}
        return key

    def _tokenize_do_it(self, request: Dict[str, Any]) -> Dict[str, Any]:
        tt = token_text_for(self.hf_tokenizer)
        ids = tt.encode(request["text"])
        if request["truncation"]:
            ids = ids[: max(request["max_length"], 0)]
        if request["encode"]:
            return {"tokens": list(ids)}
        return {"tokens": helm_texts(tt, ids)}

    def _decode_do_it(self, request: Dict[str, Any]) -> Dict[str, Any]:
        text = token_text_for(self.hf_tokenizer).hf_decode(
            request["tokens"], clean_up_tokenization_spaces=request["clean_up_tokenization_spaces"]
        )
        return {"text": text}
