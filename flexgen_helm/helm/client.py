"""HELM client: a HELM `Request` in, a `RequestResult` out, through the shared engine.

One client object per deployment (HELM may build several; they all share the engine
and its request queue through `engines.get_engine`). The work per request:
  1. HELM's cache (key: prompt, generation parameters, and what can change the numbers:
     checkpoint and compression, not placement) -- a finished run re-runs for free;
  2. otherwise a result prepared by the BatchingRunner, or a trip through the engine's
     `BatchQueue`, which merges it with the requests of the other HELM threads;
  3. conversion to HELM tokens (`tokens.TokenText`) with per-token logprobs.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from typing import Any, Dict, List, Optional

from helm.clients.client import CachingClient
from helm.common.cache import CacheConfig
from helm.common.hierarchical_logger import hlog
from helm.common.request import (
    EMBEDDING_UNAVAILABLE_REQUEST_RESULT,
    ErrorFlags,
    GeneratedOutput,
    Request,
    RequestResult,
    Token,
)

from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.helm import accounting
from flexgen_helm.helm.batching import GENERATE, SCORE, SCORE_AND_GENERATE, Job, JobOutput, get_batcher, run_jobs
from flexgen_helm.helm.engines import EngineHandle, LoadArgs, get_engine, resolve_load_args
from flexgen_helm.helm.tokens import TokenText, token_text_for

DEFAULT_MAX_BATCH = 16
# engine finish reasons -> HELM's (basic_metrics counts "length", "stop", "endoftext")
_FINISH = {"length": "length", "stop": "endoftext", "stop_string": "stop"}


class RequestFailed(Exception):
    """A request that cannot succeed (reported as a non-retriable, non-fatal error)."""


class FlexGenClient(CachingClient):
    def __init__(
        self,
        cache_config: CacheConfig,
        model: str,
        model_name: Optional[str] = None,
        path: Optional[str] = None,
        dummy: bool = False,
        policy: Any = None,
        offload_dir: Optional[str] = None,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        max_batch_size: Optional[int] = None,
        batch_linger_s: float = 0.02,
        batch_max_wait_s: float = 0.5,
        pad_tolerance: float = 0.25,
        deployment: Optional[str] = None,
    ):
        super().__init__(cache_config=cache_config)
        self.deployment = deployment or model_name or model
        self.load_args: LoadArgs = resolve_load_args(
            model, deployment=self.deployment, path=path, dummy=dummy, policy=policy,
            offload_dir=offload_dir, device=device, dtype=dtype,
        )
        self.max_batch_size = max_batch_size
        self.queue_kwargs = {"linger_s": batch_linger_s, "max_wait_s": batch_max_wait_s,
                             "pad_tolerance": pad_tolerance}
        self.pad_tolerance = pad_tolerance
        # Responses computed ahead by the BatchingRunner, by cache key (consumed once).
        self._prefetched: Dict[str, Dict[str, Any]] = {}
        self._prefetched_lock = threading.Lock()

    # ----- engine access -------------------------------------------------------------

    @property
    def handle(self) -> EngineHandle:
        return get_engine(self.load_args)

    def max_batch(self, handle: EngineHandle) -> int:
        if self.max_batch_size:
            return int(self.max_batch_size)
        policy = getattr(handle.engine, "policy", None)
        block = getattr(policy, "block_size", None)
        return int(block) if block and block > 1 else DEFAULT_MAX_BATCH

    # ----- request -> job ----------------------------------------------------------

    def raw_request(self, request: Request) -> Dict[str, Any]:
        raw = {
            "deployment": self.deployment,
            "checkpoint": self.load_args.numerics_key(),
            "prompt": request.prompt,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_tokens": request.max_tokens,
            "num_completions": request.num_completions,
            "stop_sequences": list(request.stop_sequences),
            "echo_prompt": request.echo_prompt,
        }
        return dict(CachingClient.make_cache_key(raw, request))

    def make_job(self, request: Request, raw: Dict[str, Any], handle: EngineHandle) -> tuple[Job, int]:
        """The engine job for a request, and how many tokens we prepended (a BOS)."""
        if request.messages or request.multimodal_prompt:
            raise RequestFailed("flexgen models take a plain text prompt (no chat messages, no multimodal)")
        if request.max_tokens < 0 or request.num_completions < 1:
            raise RequestFailed(f"invalid request: max_tokens={request.max_tokens}, "
                                f"num_completions={request.num_completions}")
        if not request.echo_prompt and request.max_tokens == 0:
            raise RequestFailed("max_tokens=0 without echo_prompt asks for nothing")
        tt = token_text_for(handle.tokenizer)
        ids = tt.encode(request.prompt)
        n_prefix = 0
        bos = getattr(handle.tokenizer, "bos_token_id", None)
        if _adds_bos(handle.tokenizer) and bos is not None and (not ids or ids[0] != bos):
            # The model was trained with a BOS in front (OPT's </s>); give it one, and drop it
            # from what we return so the tokens stay those of the HELM tokenizer.
            ids, n_prefix = [bos] + ids, 1
        if not ids:
            raise RequestFailed("the prompt is empty: the model needs at least one token to condition on")
        limit = handle.max_seq_len
        need = len(ids) + request.max_tokens
        if need > limit and n_prefix:
            ids, n_prefix = ids[1:], 0
            need -= 1
        if need > limit:
            raise RequestFailed(
                f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} = {need} exceeds "
                f"the model's context of {limit} tokens"
            )
        sampling = SamplingParams(
            max_new_tokens=request.max_tokens,
            temperature=float(request.temperature),
            top_p=float(request.top_p) if request.top_p else 1.0,
            stop_strings=tuple(request.stop_sequences),
            num_completions=request.num_completions,
            seed=_seed(raw) if request.temperature > 0 else None,
        )
        if request.echo_prompt:
            mode = SCORE if request.max_tokens == 0 else SCORE_AND_GENERATE
        else:
            mode = GENERATE
        group = (mode, sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                 sampling.num_completions, sampling.stop_strings)
        return Job(prompt_ids=ids, params=sampling, mode=mode, group=group), n_prefix

    # ----- job output -> cached response ---------------------------------------------

    def to_response(self, request: Request, job: Job, n_prefix: int, out: JobOutput, tt: TokenText
                    ) -> Dict[str, Any]:
        """A JSON-able response (what HELM's cache stores)."""
        prompt_tokens: List[List[Any]] = []
        if out.score is not None:
            ids = job.prompt_ids[n_prefix:]
            lps = out.score.logprobs[n_prefix:]
            texts = tt.helm_texts(ids)
            # No context for the first token (unless we prepended a BOS): 0.0, as HELM's
            # HuggingFaceClient does; the LM adapter treats that token as conditioning.
            prompt_tokens = [[t, _finite(lp)] for t, lp in zip(texts, lps)]
        completions = []
        generated_total = 0
        n = request.num_completions
        gen_completions = out.generation.completions if out.generation is not None else [None] * n
        for comp in gen_completions[:n]:
            tokens = list(prompt_tokens)
            text = request.prompt if request.echo_prompt else ""
            reason = "length"
            if comp is not None:
                ids, lps = list(comp.token_ids), list(comp.logprobs)
                reason = _FINISH.get(comp.finish_reason, "unknown")
                eos = set(job.params.stop_token_ids) | {getattr(tt.tokenizer, "eos_token_id", None)}
                if reason == "endoftext" and ids and ids[-1] in eos:
                    ids, lps = ids[:-1], lps[:-1]  # the EOS itself is not part of the text
                ids, gen_text, stopped = tt.cut_at_stop(ids, job.params.stop_strings)
                if stopped:
                    reason = "stop"
                lps = lps[: len(ids)]
                generated_total += len(ids)
                tokens += [[t, float(lp)] for t, lp in zip(tt.helm_texts(ids), lps)]
                text += gen_text
            completions.append({"text": text, "tokens": tokens, "finish_reason": reason})
        return {
            "completions": completions,
            "flexgen": accounting.request_record(len(job.prompt_ids), generated_total, out.batch),
        }

    # ----- HELM entry points ---------------------------------------------------------

    def make_request(self, request: Request) -> RequestResult:
        if request.embedding:
            return EMBEDDING_UNAVAILABLE_REQUEST_RESULT
        raw = self.raw_request(request)
        key = _key_str(raw)

        def compute() -> Dict[str, Any]:
            with self._prefetched_lock:
                ready = self._prefetched.pop(key, None)
            if ready is not None:
                if "error" in ready:
                    raise RequestFailed(ready["error"])
                return ready
            handle = self.handle
            job, n_prefix = self.make_job(request, raw, handle)
            queue = get_batcher(handle, self.max_batch(handle), **self.queue_kwargs)
            try:
                out = queue.submit(job).result()
            except Exception as exc:  # engine errors become request errors
                raise RequestFailed(str(exc)) from exc
            return self.to_response(request, job, n_prefix, out, token_text_for(handle.tokenizer))

        try:
            response, cached = self.cache.get(raw, _timed(compute))
        except RequestFailed as exc:
            return failed_result(str(exc))
        return self.to_result(response, cached)

    def prefetch(self, requests: List[Request]) -> int:
        """Compute every uncached request at once, in batches (the BatchingRunner's path).

        Results wait in memory until `make_request` asks for them, so HELM's own executor,
        cache and error handling stay in charge. Returns the number of requests computed.
        """
        todo_keys, _ = self.split_cached(requests)
        by_key = {self.cache_key(r): r for r in requests if not r.embedding}
        computed = self.compute_now([by_key[k] for k in todo_keys])
        for key, response in computed.items():
            self.keep(key, response)
        return len(computed)

    def cache_key(self, request: Request) -> str:
        return _key_str(self.raw_request(request))

    def split_cached(self, requests: List[Request]) -> tuple[List[str], Dict[str, Dict[str, Any]]]:
        """(keys still to compute, in order and once each; {key: response} from HELM's cache)."""
        from helm.common.cache import create_key_value_store

        todo: List[str] = []
        seen = set(self._prefetched)
        cached: Dict[str, Dict[str, Any]] = {}
        with create_key_value_store(self.cache.config) as store:
            for request in requests:
                if request.embedding:
                    continue
                raw = self.raw_request(request)
                key = _key_str(raw)
                if key in seen:
                    continue
                seen.add(key)
                hit = store.get(raw)
                if hit is not None:
                    cached[key] = hit
                else:
                    todo.append(key)
        return todo, cached

    def compute_now(self, requests: List[Request]) -> Dict[str, Dict[str, Any]]:
        """{cache key: response (or {"error": ...})} for requests, run in length-bucketed batches."""
        if not requests:
            return {}
        handle = self.handle
        tt = token_text_for(handle.tokenizer)
        out: Dict[str, Dict[str, Any]] = {}
        jobs = []
        for request in requests:
            raw = self.raw_request(request)
            key = _key_str(raw)
            try:
                job, n_prefix = self.make_job(request, raw, handle)
            except RequestFailed as exc:
                out[key] = {"error": str(exc)}
                continue
            jobs.append((request, key, job, n_prefix))
        hlog(f"flexgen: running {len(jobs)} requests in batches of up to {self.max_batch(handle)}")
        run_jobs(handle, [j for _, _, j, _ in jobs], self.max_batch(handle), self.pad_tolerance,
                 progress=f"flexgen {self.deployment}")
        for request, key, job, n_prefix in jobs:
            exc = job.future.exception()
            if exc is not None:
                out[key] = {"error": str(exc)}
                continue
            result = job.future.result()
            out[key] = self.to_response(request, job, n_prefix, result, tt)
            # computed in its batch, not when make_request picks it up
            out[key]["request_time"] = result.batch["batch_time_s"]
            out[key]["request_datetime"] = int(result.batch["batch_started"])
        return out

    def keep(self, key: str, response: Dict[str, Any]) -> None:
        """Hold a response computed ahead until `make_request` asks for it."""
        with self._prefetched_lock:
            self._prefetched[key] = response

    @staticmethod
    def to_result(response: Dict[str, Any], cached: bool) -> RequestResult:
        completions = []
        for i, c in enumerate(response["completions"]):
            tokens = [Token(text=t, logprob=lp) for t, lp in c["tokens"]]
            finish: Dict[str, Any] = {"reason": c["finish_reason"]}
            if i == 0 and response.get("flexgen"):
                finish["flexgen"] = response["flexgen"]
            completions.append(GeneratedOutput(text=c["text"], logprob=sum(t.logprob for t in tokens),
                                               tokens=tokens, finish_reason=finish))
        batch = response.get("flexgen") or {}
        return RequestResult(
            success=True,
            cached=cached,
            request_time=response.get("request_time"),
            request_datetime=response.get("request_datetime"),
            completions=completions,
            embedding=[],
            batch_size=batch.get("batch_size"),
            batch_request_time=batch.get("batch_time_s"),
        )


def _timed(compute):
    """HELM's wrap_request_time, except that a response computed ahead in a batch keeps that
    batch's time (picking it up takes microseconds, which HELM would report as its runtime)."""

    def run() -> Dict[str, Any]:
        start = time.time()
        response = compute()
        if "request_time" not in response:
            response["request_time"] = time.time() - start
            response["request_datetime"] = int(start)
        return response

    return run


def failed_result(error: str) -> RequestResult:
    # Not retriable (the same request fails the same way), not fatal (the run goes on;
    # HELM records an empty completion for it).
    return RequestResult(success=False, cached=False, error=f"flexgen: {error}", completions=[], embedding=[],
                         error_flags=ErrorFlags(is_retriable=False, is_fatal=False))


_ADDS_BOS: Dict[int, bool] = {}


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer's default encoding starts with a BOS (as the model was trained).
    A tokenizer without a BOS token encodes "a" like any other and answers False; one that
    cannot encode at all raises here, with its own error, rather than passing for BOS-less."""
    if id(tokenizer) not in _ADDS_BOS:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            _ADDS_BOS[id(tokenizer)] = False
        else:
            with token_text_for(tokenizer).call_lock:
                ids = tokenizer("a")["input_ids"]
            _ADDS_BOS[id(tokenizer)] = len(ids) > 0 and ids[0] == bos
    return _ADDS_BOS[id(tokenizer)]


def _key_str(raw: Dict[str, Any]) -> str:
    return json.dumps(raw, sort_keys=True)


def _seed(raw: Dict[str, Any]) -> int:
    """A sampling seed fixed by the request, so a result does not depend on its batch."""
    return int.from_bytes(hashlib.sha256(_key_str(raw).encode()).digest()[:4], "little") & 0x7FFFFFFF


def _finite(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else 0.0
