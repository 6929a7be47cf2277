"""One engine per model per process, shared by every HELM client and tokenizer.

HELM builds clients lazily and calls `make_request` from a thread pool, and its
tokenizer is built separately from the client: both must reach the *same* loaded
model, or a 30B checkpoint would be loaded twice. The registry is keyed by the
arguments that change what is loaded (`LoadArgs`) and guarded by a lock so that
two threads asking at once load once.

How a deployment finds its weights and policy (first match wins):
  1. the client / tokenizer args in a model_deployments.yaml (`path`, `policy`, ...);
  2. environment variables:
       FLEXGEN_HELM_WEIGHTS_DIR   a folder with one sub-folder per model, named like the
                                  deployment without its "flexgen/" (e.g. .../opt-30b);
                                  a dummy deployment whose folder exists there loads it
       FLEXGEN_HELM_POLICY        Policy fields as JSON, the path of a JSON file, or "auto" (searched by
                                  the cost model for the model's full context and this machine)
       FLEXGEN_HELM_DEVICE        "cuda", "cuda:1", "cpu"
       FLEXGEN_HELM_DTYPE         "float32", "bfloat16", "float16" (default: the device's, see
                                  memory/devices.py)
       FLEXGEN_HELM_OFFLOAD_DIR   where the disk tier lives
  3. defaults: random ("dummy") weights for OPT; for the policy fields left open, the planner's
     choice for this machine when the engine loads (planner/auto.py: the fastest block it
     predicts for HELM's short prompts; without a saved profile, the engine's fixed default,
     said in one line).
FLEXGEN_HELM_ENGINE_FACTORY="module:function" swaps Engine.load for another loader
(tests use it to run HELM end to end against a small fake engine).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flexgen_helm.errors import FlexGenError


@dataclass(frozen=True)
class LoadArgs:
    """What identifies a loaded engine (hashable: the registry key)."""

    model: str
    path: str | None = None
    dummy: bool = False
    # canonical JSON of the Policy fields the deployment sets (None: none); the planner chooses
    # the rest when the engine loads (planner/auto.py), for the model's full context if `auto`
    policy_json: str | None = None
    auto: bool = False
    offload_dir: str | None = None
    device: str | None = None
    dtype: str | None = None

    def numerics_key(self) -> dict:
        """The part of the load args that can change the numbers a model produces.

        Placement and batching never change the answer (a design invariant); compression
        and sparse attention do, so they belong in HELM's cache key, the rest does not.
        """
        policy = json.loads(self.policy_json) if self.policy_json else {}
        return {
            "model": self.model,
            "path": self.path,
            "dummy": self.dummy,
            "dtype": self.dtype,
            "compress_weight": policy.get("compress_weight"),
            "compress_cache": policy.get("compress_cache"),
            "attn_sparsity": policy.get("attn_sparsity", 1.0),
        }


def _policy_fields(value: Any) -> dict:
    """The Policy fields a deployment sets, from a dict (YAML), a JSON string, a path to a JSON
    file, or a Policy (all of its fields); None: none."""
    from flexgen_helm.policy import Policy

    if value is None:
        return {}
    if isinstance(value, Policy):
        return value.to_dict()
    if isinstance(value, str):
        if os.path.isfile(value):
            with open(value) as f:
                value = json.load(f)
        else:
            value = json.loads(value)
    if not isinstance(value, dict):
        raise FlexGenError(f"a policy must be a mapping, JSON text or a JSON file, got {value!r}")
    value = dict(value)
    if "percent" in value:  # FlexGen's --percent: six numbers, for weights, cache and activations
        placed = Policy.from_percent(value.pop("percent")).to_dict()
        value.update({k: placed[k] for k in ("weights", "cache", "activations")})
    Policy.from_dict(value)  # a bad field or value fails here, before any work
    return value


def resolve_load_args(
    model: str,
    deployment: str | None = None,
    path: str | None = None,
    dummy: bool | None = None,
    policy: Any = None,
    offload_dir: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> LoadArgs:
    """Fill what the deployment's args leave open from the environment (see module doc)."""
    env = os.environ
    if path is None and env.get("FLEXGEN_HELM_WEIGHTS_DIR") and deployment:
        candidate = os.path.join(env["FLEXGEN_HELM_WEIGHTS_DIR"], deployment.split("/")[-1])
        if os.path.isdir(candidate):
            path = candidate
    if path is not None:
        path = os.path.abspath(os.path.expanduser(path))
        dummy = False
    if policy is None and env.get("FLEXGEN_HELM_POLICY"):
        policy = env["FLEXGEN_HELM_POLICY"]
    auto = policy == "auto"
    fields = {} if auto else _policy_fields(policy)
    return LoadArgs(
        model=model,
        path=path,
        dummy=bool(dummy),
        policy_json=json.dumps(fields, sort_keys=True) if fields else None,
        auto=auto,
        offload_dir=offload_dir or env.get("FLEXGEN_HELM_OFFLOAD_DIR"),
        device=device or env.get("FLEXGEN_HELM_DEVICE"),
        dtype=dtype or env.get("FLEXGEN_HELM_DTYPE"),
    )


def _load(args: LoadArgs):
    """The engine of `args`: under the deployment's policy fields and the planner's choice for
    the rest; a FLEXGEN_HELM_ENGINE_FACTORY loader gets the deployment's fields alone."""
    from flexgen_helm.policy import Policy

    fields = json.loads(args.policy_json) if args.policy_json else {}
    kwargs = dict(path=args.path, dummy=args.dummy, offload_dir=args.offload_dir, device=args.device,
                  dtype=args.dtype)
    spec = os.environ.get("FLEXGEN_HELM_ENGINE_FACTORY")
    if spec:
        module, _, func = spec.partition(":")
        return getattr(importlib.import_module(module), func)(
            args.model, policy=Policy.from_dict(fields) if fields else None, **kwargs)
    from flexgen_helm.engine import Engine
    from flexgen_helm.planner.auto import policy_for_model
    from flexgen_helm.planner.hardware_profile import use_profile

    policy = policy_for_model(args.model, path=args.path, dummy=args.dummy, pinned=fields, auto=args.auto,
                              device=args.device, dtype=args.dtype)
    use_profile()  # the disk reader and the int4 kernel's crossover this machine's profile measured
    return Engine.load(args.model, policy=policy, **kwargs)


class EngineHandle:
    """A loaded engine plus the lock that serializes calls into it.

    The engine itself is not assumed thread-safe: every call goes through `lock`.
    """

    def __init__(self, args: LoadArgs, engine: Any, planned_fields: dict | None = None, loading: Any = None):
        self.args = args
        self.engine = engine
        # its loading (accounting.EngineLoad), which every request it computes records
        self.loading = loading
        self.lock = threading.Lock()
        self.batcher = None  # set by batching.get_batcher (one request queue per engine)
        # the deployment's Policy fields where the planner chose the rest: each scenario's block
        # is planned again for its requests (helm/block_planning.py); None: nothing to plan
        self.planned_fields = planned_fields

    @contextmanager
    def running_under(self, policy: Any) -> Iterator[None]:
        """The engine runs under `policy` (planned for a scenario's requests, the weights as
        loaded: Engine.set_policy) until the block ends, then under its loaded policy again;
        None: the loaded policy throughout."""
        if policy is None:
            yield
            return
        loaded = self.engine.policy
        self.engine.set_policy(policy)
        try:
            yield
        finally:
            self.engine.set_policy(loaded)

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer: the one HELM's window service loaded (get_tokenizer) where
        it did, so that HELM and the client tokenize with one object (one load, and the client
        finds each prompt the window service encoded: TokenText.encode), else the engine's."""
        loaded = _TOKENIZERS.get((self.args.model, self.args.path, self.args.dummy))
        return loaded if loaded is not None else self.engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return int(self.engine.config.max_seq_len)


_REGISTRY: dict[LoadArgs, EngineHandle] = {}
_REGISTRY_LOCK = threading.Lock()


def get_engine(args: LoadArgs) -> EngineHandle:
    """The process-wide engine for `args`, loading it on first use (once, under a lock)."""
    handle = _REGISTRY.get(args)
    if handle is not None:
        return handle
    with _REGISTRY_LOCK:
        handle = _REGISTRY.get(args)
        if handle is None:
            from flexgen_helm.helm.accounting import EngineLoad  # (torch, as _load's imports: not at import)

            t0 = time.perf_counter()
            engine = _load(args)
            loading = EngineLoad(uuid.uuid4().hex[:12], time.perf_counter() - t0)
            handle = _REGISTRY[args] = EngineHandle(args, engine, _planned_fields(args), loading)
    return handle


def _planned_fields(args: LoadArgs) -> dict | None:
    """The deployment's Policy fields where the planner chooses the rest (a block or the
    placement left open) for the real engine; None for a policy pinned whole or a stand-in
    engine (FLEXGEN_HELM_ENGINE_FACTORY, which gets the deployment's fields alone)."""
    from flexgen_helm.planner.auto import leaves_open

    if os.environ.get("FLEXGEN_HELM_ENGINE_FACTORY"):
        return None
    fields = json.loads(args.policy_json) if args.policy_json else {}
    return fields if leaves_open(fields) else None


def get_tokenizer(args: LoadArgs):
    """The engine's tokenizer, without loading a second copy of the model.

    Reuses any loaded engine of the same checkpoint (whatever its policy); else loads the
    tokenizer alone through the model registry (no weights read), as the engine would.
    """
    for key, handle in list(_REGISTRY.items()):
        if (key.model, key.path, key.dummy) == (args.model, args.path, args.dummy):
            return handle.tokenizer
    if os.environ.get("FLEXGEN_HELM_ENGINE_FACTORY"):
        return get_engine(args).tokenizer
    with _REGISTRY_LOCK:
        key = (args.model, args.path, args.dummy)
        if key not in _TOKENIZERS:
            from flexgen_helm.weights.registry import resolve

            _TOKENIZERS[key] = resolve(args.model, path=args.path, dummy=args.dummy).load_tokenizer()
        return _TOKENIZERS[key]


_TOKENIZERS: dict[tuple, Any] = {}


def clear() -> None:
    """Forget every loaded engine (tests)."""
    with _REGISTRY_LOCK:
        for handle in _REGISTRY.values():
            if handle.batcher is not None:
                handle.batcher.close()
        _REGISTRY.clear()
        _TOKENIZERS.clear()
