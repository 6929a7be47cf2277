"""Tokenizers for the models we resolve: from a Hugging Face directory, from a GGUF file
(cached, since parsing its vocabulary takes seconds), or a byte-level stand-in for dummy
weights that ship no tokenizer files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from flexgen_helm.errors import ModelNotFoundError
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.torchvision_guard import hide_broken_torchvision


def import_transformers():
    """transformers, importable even next to a broken torchvision (see torchvision_guard)."""
    hide_broken_torchvision()
    import transformers

    return transformers


# Classes that are a tokenizer.json run by the tokenizers library, with nothing of one model's
# own: the folder a GGUF's tokenizer was saved to names one of them, and is loaded by that class,
# as AutoTokenizer loads it there, without importing AutoTokenizer's registry of every model
# family (~0.5 s of each helm-run, whose client has imported torch already; 2.5 s without torch:
# runs/bench/plan_time). Not for a checkpoint's folder: there AutoTokenizer may replace the class
# its files name by the one it registered for the model type in its config.json.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_saved_tokenizer(directory: str | os.PathLike):
    """A tokenizer we saved to `directory` (a GGUF's, gguf_tokenizer): by the class its
    tokenizer_config.json names where that is a generic one, else by AutoTokenizer."""
    transformers = import_transformers()
    named = _configured_class(Path(directory))
    if named in GENERIC_TOKENIZER_CLASSES and hasattr(transformers, named):
        return getattr(transformers, named).from_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _configured_class(directory: Path) -> str | None:
    # an unreadable config is AutoTokenizer's to report, with its own message
    try:
        return json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def hf_tokenizer(model_dir: str | os.PathLike):
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{model_dir}: no usable tokenizer files ({e})") from e


def gguf_tokenizer(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike):
    """The tokenizer embedded in a GGUF file, saved once under cache_dir and reloaded from there."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = Path(cache_dir) / "tokenizers" / f"{path.stem}-{key}"
    if cached.is_dir():
        return load_saved_tokenizer(cached)
    tok = import_transformers().AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # Save beside the final name and rename, so a reader never sees half a cache entry.
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        tmp.rename(cached)
    except OSError:
        pass  # another process won the race, or the cache is read-only: the tokenizer still works
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


# OPT's special tokens and ids; the 256 byte tokens follow them.
_STANDIN_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def byte_standin_tokenizer(cfg: ModelConfig):
    """A STAND-IN tokenizer for dummy weights: one token per UTF-8 byte.

    Not the model's real tokenizer, so its ids mean nothing to real weights; it exists so
    that dummy-weight runs (benchmarks of the offloading engine) can turn text into ids and
    back without any tokenizer files. Special ids follow OPT: <pad>=1, </s>=2 as bos and
    eos, and like OPT's tokenizer it prepends </s> to every sequence.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    transformers = import_transformers()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(_STANDIN_SPECIALS)}
    vocab.update({ch: len(_STANDIN_SPECIALS) + i for i, ch in enumerate(alphabet)})
    if len(vocab) > cfg.vocab_size:
        raise ModelNotFoundError(
            f"{cfg.name}: vocabulary of {cfg.vocab_size} is too small for the byte stand-in tokenizer")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="</s> $A", pair="</s> $A </s> $B", special_tokens=[("</s>", vocab["</s>"])]
    )
    tok.add_special_tokens(list(_STANDIN_SPECIALS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        name_or_path="flexgen-helm/byte-standin",
    )
