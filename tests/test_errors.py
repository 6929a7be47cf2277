"""Bad input gets a clear error that names the problem, and leaves no partial files."""

from __future__ import annotations

import errno
import os
import re
import shutil

import pytest

from flexgen_helm.cli import main
from flexgen_helm.engine import Engine
from flexgen_helm.errors import (
    FlexGenError,
    ModelNotFoundError,
    OffloadDirError,
    PolicyError,
    PromptTooLongError,
    WeightStoreError,
)
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.policy import Policy, Split


def test_policy_fractions_must_sum_to_one():
    with pytest.raises(PolicyError, match="sum to 1.1"):
        Policy(weights=Split(0.5, 0.6, 0.0))
    with pytest.raises(PolicyError, match="outside"):
        Policy(cache=Split(1.5, -0.5, 0.0))
    with pytest.raises(PolicyError, match="gpu_batch_size must be a positive integer"):
        Policy(gpu_batch_size=0)


def test_cli_reports_bad_percent(capsys):
    assert main(["generate", "--model", "facebook/opt-125m", "--dummy", "--percent", "60", "50", "100", "0", "100",
                 "0", "--prompt", "hi"]) == 2
    assert "gpu 60.0 + cpu 50.0 exceeds 100" in capsys.readouterr().err


def test_cli_reports_unknown_model(capsys):
    assert main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "1.5"], r"top_p must be in \(0, 1\], got 1.5"),
    (["--num-completions", "0"], "num_completions must be >= 1, got 0"),
    (["--top-k", "-2"], r"top_k must be >= 0 \(0: no top-k filter\), got -2"),
    (["--stop", "\n", ""], "stop string 1 is empty: it would stop nothing"),
    (["--prompt", "word " * 70], r"prompt 1 has \d+ tokens; with 32 new tokens .* context of .* \(64 tokens\)"),
])
def test_generate_refuses_a_bad_request_before_the_model_loads(tiny_llama, monkeypatch, capsys, flags, message):
    """Loading a large model takes minutes: what generation would refuse is refused first."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    assert main(["generate", "--model", str(tiny_llama), "--device", "cpu", "--prompt", "hi", *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_refuses_an_empty_prompt_before_the_model_loads(monkeypatch, capsys):
    """SmolLM2's tokenizer adds no BOS: "" encodes to no token at all."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "hi", "", "--max-new-tokens", "2"]) == 2
    assert "prompt 1 is empty (no tokens)" in capsys.readouterr().err


def test_bench_refuses_a_prompt_longer_than_the_context_before_the_model_loads(tiny_llama, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("the model was loaded")))
    assert main(["bench", "--model", str(tiny_llama), "--device", "cpu", "--prompt-len", "60", "--gen-len", "8"]) == 2
    assert "each prompt (--prompt-len) has 60 tokens; with 8 new tokens that is 68, more than the context of " \
        in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--path", "{tmp}/missing.gguf"], ["--model", "{tmp}/missing"],
                                   ["--model", "smollm2-135m", "--path", "{tmp}/missing"]])
def test_a_missing_model_path_is_named_as_missing(tmp_path, capsys, flags):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["generate", *flags, "--prompt", "hi"]) == 2
    assert f"{flags[-1]}: no such file or directory" in capsys.readouterr().err


def test_opt_without_weights_says_what_to_pass():
    with pytest.raises(ModelNotFoundError, match="--path DIR .* or --dummy"):
        Engine.load("facebook/opt-1.3b")


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    return Engine.load(str(tiny_llama), Policy(cache=Split(0, 0, 1)), dtype="float32", device="cpu",
                       offload_dir=tmp_path_factory.mktemp("offload"), progress=False)


def test_prompt_longer_than_context(engine):
    with pytest.raises(PromptTooLongError, match=r"more than the context of .* \(64 tokens\)"):
        engine.generate([list(range(1, 60))], SamplingParams(max_new_tokens=10))
    assert list(engine.offload_dir.glob("run-*")) == []


def test_empty_prompts(engine):
    with pytest.raises(FlexGenError, match="no prompts"):
        engine.generate([])
    with pytest.raises(FlexGenError, match="prompt 1 is empty"):
        engine.generate([[5, 6], []])


def test_missing_weight_file(tiny_llama, tmp_path):
    broken = shutil.copytree(tiny_llama, tmp_path / "m")
    for f in broken.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FlexGenError, match="weight"):
        Engine.load(str(broken), dtype="float32", device="cpu", progress=False)


def test_corrupt_store_is_detected(tiny_opt, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(tmp_path / "cache"))
    Engine.load(str(tiny_opt), dtype="float32", device="cpu", progress=False)
    victim = sorted((tmp_path / "cache" / "stores").glob("*/layers.1.fc1.weight.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="checksum mismatch .* layers.1.fc1.weight"):
        Engine.load(str(tiny_opt), dtype="float32", device="cpu", progress=False)


def test_unwritable_offload_dir(tiny_llama, tmp_path):
    """Found when the engine loads (tests/test_cli.py), and again if it goes away after."""
    offload = tmp_path / "offload"
    engine = Engine.load(str(tiny_llama), Policy(cache=Split(0, 0, 1)), dtype="float32", device="cpu",
                         offload_dir=offload, progress=False)
    offload.rmdir()
    offload.write_text("x")  # a file where the folder was
    with pytest.raises(FlexGenError, match="offload directory .* not usable"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_full_disk_is_reported_and_cleaned_up(engine, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadDirError, match=r"disk full: an offload file at .*kv-0-0\.bin needs 640 bytes, .* free"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert list(engine.offload_dir.glob("run-*")) == []
