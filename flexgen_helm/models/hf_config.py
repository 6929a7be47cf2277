"""Reading the parts of a transformers config.json that several families share: rotary
parameters (the flat and the per-layer-type forms of transformers >= 5, and the older
rope_theta / rope_scaling keys) and which blocks attend through a sliding window."""

from __future__ import annotations

from typing import Callable


def first(x):
    """The first of a list (eos_token_id may be one), or x itself."""
    return x[0] if isinstance(x, list) else x


def as_pairs(d: dict | None) -> tuple:
    """A dict as sorted (key, value) pairs, lists as tuples: hashable, for ModelConfig."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (d or {}).items()
                        if not isinstance(v, dict)))


def rope_from_hf(hf: dict, layer_type: str | None = None, default_theta: float = 10000.0,
                 theta_key: str = "rope_theta", use_scaling: bool = True) -> tuple[float, dict]:
    """(theta, scaling) for the blocks of `layer_type` ("full_attention" or
    "sliding_attention" where transformers nests them, None for a single set). Older
    configs name the base `theta_key` and the scaling `rope_scaling`; scaling keys other
    than the type and its parameters (theta, partial_rotary_factor) are dropped, and a
    "default" scaling is none."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        params = {}  # nested, but not by this layer type
    theta = params.pop("rope_theta", None) or hf.get(theta_key) or default_theta
    params.pop("partial_rotary_factor", None)
    scaling = (hf.get("rope_scaling") or params) if use_scaling else {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return float(theta), dict(scaling)


def partial_rotary_factor(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


def sliding_windows(hf: dict, num_layers: int, window: int | None, is_sliding: Callable[[int], bool]) -> tuple:
    """Per block, its window (0: none): the config's layer_types where it lists them, else
    the family's rule `is_sliding(block)`; () when no block slides."""
    if not window:
        return ()
    types = hf.get("layer_types")
    flags = [t == "sliding_attention" for t in types] if types else [is_sliding(i) for i in range(num_layers)]
    return tuple(int(window) if f else 0 for f in flags) if any(flags) else ()
