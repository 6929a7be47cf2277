"""Shared fixtures: tiny random checkpoints written with transformers, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flexgen_helm.models.tokenizer import byte_standin_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _transformers():
    from flexgen_helm.models.tokenizer import import_transformers

    return import_transformers()


# Small random configurations of the newer families: sliding windows (4 positions) shorter
# than the test prompts, Gemma's scales and soft-caps small enough to matter, head_dim apart
# from hidden / heads, Phi-3's LongRoPE with a pretraining context of 16.
_SHAPE = dict(vocab_size=300, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              max_position_embeddings=64)
TINY_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_SHAPE, num_hidden_layers=2, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _SHAPE, num_hidden_layers=3, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0, final_logit_softcapping=2.0, attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _SHAPE, num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        _SHAPE, num_hidden_layers=2, original_max_position_embeddings=16, sliding_window=6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
}


def _gpt_oss_swiglu_limit() -> float:
    """The SwiGLU limit of the tiny gpt-oss: 1.5, which binds on its random weights, where the
    installed transformers reads config.swiglu_limit (5.19 and later); before 5.19 its experts
    clamp at 7.0 whatever the config says (and use alpha 1.702), so a reference built with 1.5
    would compute another model than the config describes: the comparison then takes 7.0.
    (5.17 with 1.5: log-probs up to 0.32 off, the GPU images' failures: runs/moe/gpt_oss_transformers_versions.)"""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("transformers").split(".")[:2])
    return 1.5 if (major, minor) >= (5, 19) else 7.0


# Mixtures of experts: 4 experts, 2 per token; Mixtral's window on every block; Qwen2-MoE's
# shared expert and a dense block (mlp_only_layers), Qwen3-MoE renormalising its top-k and
# OLMoE not, OLMoE's clamp (small enough to bind on its normalised queries and keys)
_MOE = dict(_SHAPE, num_hidden_layers=2, num_experts_per_tok=2)
TINY_FAMILIES.update({
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_MOE, num_local_experts=4, intermediate_size=64,
                                                                    sliding_window=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _MOE, num_hidden_layers=3, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_MOE, num_experts=4, intermediate_size=32, clip_qkv=1.5,
                                                     eos_token_id=2, pad_token_id=1)),
    # gpt-oss: sliding (window 4) and full blocks, YaRN over a pretraining context of 16 (the
    # ramp's both ends inside the head), the clamped SwiGLU's limit small enough to bind where
    # the reference reads it (_gpt_oss_swiglu_limit)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _MOE, num_hidden_layers=3, head_dim=16, num_local_experts=4, intermediate_size=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=_gpt_oss_swiglu_limit(),
        eos_token_id=2, pad_token_id=1, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
})


# The engine's compute device in the tests that run the engine on a GPU too (`pytest
# --device cuda`: the policy-invariance, transformers-equivalence and family tests); read
# when the test modules are imported, so module-level settings may use it.
_RUN = {"device": "cpu"}


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="the engine's compute device in the policy-invariance and equivalence tests")


def pytest_configure(config):
    _RUN["device"] = config.getoption("--device")
    _share_the_cores_between_workers()
    if _RUN["device"] == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA GPU on this machine")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup (the test command's): each module runs on one
    worker, so its module fixtures are built once; the modules that read the fake HELM suite
    (fake_helm_suite, a session fixture: one helm-run of nine runs, the suite's costliest
    setup) run on the same worker, so it is built once too."""
    readers = {item.path for item in items if "fake_helm_suite" in item.fixturenames}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("fake_helm_suite" if item.path in readers else item.path.name))


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (`-n N`, the test command's), each worker computes on its share of
    the cores (those this process may run on), and so do the processes its tests start
    (helm-run, through OMP_NUM_THREADS; pipeline ranks set their own, the cores over the
    ranks): N workers each running torch on every core would oversubscribe them, and torch's
    threads spin-wait on one another (small ops then run up to 10x slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def engine_device() -> str:
    return _RUN["device"]


def compute_dtypes() -> list[str]:
    """float32 everywhere; float16 too on a GPU, where it is the default (slow on CPUs)."""
    return ["float32", "float16"] if engine_device() == "cuda" else ["float32"]


def save_tiny(kind: str, path: Path, **overrides) -> Path:
    """A small random checkpoint of an architecture, saved as safetensors."""
    tf = _transformers()
    torch.manual_seed(0)
    if kind == "opt":
        cfg = tf.OPTConfig(**{**dict(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32), **overrides})
        model = tf.OPTForCausalLM(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(**{**dict(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                       rope_theta=50000.0), **overrides})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64, **overrides)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind in TINY_FAMILIES:
        config_class, model_class, kwargs = TINY_FAMILIES[kind]
        cfg = getattr(tf, config_class)(**{**kwargs, **overrides})
        model = getattr(tf, model_class)(cfg)
        with torch.no_grad():  # norms start at 1 (or Gemma's offset at 0): random, so that each one counts
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.2)
                elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")):
                    p.normal_(0, 1.0)  # routers: logits spread, so that no two experts tie for a token
                elif name.endswith("self_attn.sinks"):
                    p.normal_(0, 1.0)  # gpt-oss's sinks: of the scores' size, so that they matter
                elif kind == "gpt_oss" and name.endswith("_proj.bias"):
                    p.normal_(0, 0.2)  # its attention biases start at zero: random, so that each one counts
                elif "expert" in name:  # experts' outputs as large as the residual: each one counts
                    p.normal_(0, 0.2)
    else:
        raise ValueError(kind)
    model.save_pretrained(path, safe_serialization=True)
    # a byte-level tokenizer, so that text prompts and completions work too
    byte_standin_tokenizer(SimpleNamespace(vocab_size=cfg.vocab_size, name=kind)).save_pretrained(path)
    return path


def fake_quantized_checkpoint(src: Path, dst: Path, cfg) -> Path:
    """The checkpoint with every tensor the engine compresses (>= 2-D: projections,
    embeddings, positions, an untied lm_head) replaced by its simulated quantization. Our
    store tensors have the checkpoint's names' shapes and (out, in) orientation, and a tied
    lm_head is the embedding itself, so this is the same set of tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from flexgen_helm.compression import fake_quantize, should_compress, weight_group_dim

    def simulated(t: torch.Tensor) -> torch.Tensor:
        return fake_quantize(t, cfg, weight_group_dim(cfg, t.shape)) if should_compress(t.shape) else t

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        state = load_file(f)
        state = {k: _gpt_oss_experts_simulated(k, t, simulated) if ".mlp.experts." in k else simulated(t)
                 for k, t in state.items()}
        save_file(state, f, metadata={"format": "pt"})
    return dst


def _gpt_oss_experts_simulated(name: str, t: torch.Tensor, simulated) -> torch.Tensor:
    """A fused gpt-oss expert tensor with each expert's projection simulated as the store holds
    it (out, in), one tensor per expert and projection (weights/hf_checkpoint.GPT_OSS_EXPERTS):
    gate_up_proj's interleaved gate (even) and up (odd) columns apart; the biases (1-D per
    expert) as they are. Other families' experts are tensors of their own: simulated whole."""
    if name.endswith("experts.gate_up_proj"):
        out = t.clone()
        for e in range(t.shape[0]):
            for columns in (0, 1):
                out[e][:, columns::2] = simulated(t[e][:, columns::2].T.contiguous()).T
        return out
    if name.endswith("experts.down_proj"):
        return torch.stack([simulated(x.T.contiguous()).T for x in t])
    if name.endswith("_proj_bias"):
        return t
    return simulated(t)


def hf_model(path: Path):
    return _transformers().AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    return save_tiny("opt", tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """Three of four blocks slide (window 4, shorter than most test prompts): ring caches."""
    return save_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The bundled SmolLM2-135M GGUF as a weight source, one for the session: a source parses
    the file (its 49k-string vocabulary: seconds) when it first reads a tensor, so the tests
    that read the file themselves share one parse."""
    from flexgen_helm.weights.registry import resolve

    return resolve("smollm2-135m").source


# The deployments of the fake HELM suite (fake_helm_suite): uncompressed, 8-bit, 4-bit
FAKE_SUITE_DEPLOYMENTS = ("flexgen/smollm2-135m", "flexgen/smollm2-135m-8bit", "flexgen/smollm2-135m-4bit")


@pytest.fixture(scope="session")
def fake_helm_suite(tmp_path_factory) -> Path:
    """One helm-run (BatchingRunner, the fake engine) of lambada, wikitext and pattern matching
    on the three FAKE_SUITE_DEPLOYMENTS, three instances each; its folder (outputs in out/,
    suite "t"). Several tests read it (test_helm_schema summarizes it, test_helm_e2e's
    BatchingRunner test and test_helm_data_parallel's single-process reference read its
    flexgen/smollm2-135m runs): each helm-run starts in seconds of imports and HELM's own
    configuration, one start instead of three."""
    pytest.importorskip("helm")
    from test_helm_e2e import ENTRIES, helm_run

    tmp = tmp_path_factory.mktemp("fake-helm-suite")
    entries = [e.replace("model=flexgen/smollm2-135m", f"model={d}") for d in FAKE_SUITE_DEPLOYMENTS for e in ENTRIES]
    # the session's cache set here: a session fixture runs before the autouse _isolated_cache
    helm_run(tmp, entries, "--runner-class-name", "flexgen_helm.helm.runner.BatchingRunner", fake=True,
             max_instances=3, env=dict(os.environ, **session_cache_env(tmp_path_factory)))
    return tmp


def session_cache_env(tmp_path_factory) -> dict[str, str]:
    """The variables that put stores converted by tests in a per-session cache, not the user's."""
    base = tmp_path_factory.getbasetemp()
    return {"FLEXGEN_HELM_CACHE": str(base / "flexgen-cache"), "FLEXGEN_HELM_OFFLOAD": str(base / "offload")}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test's stores in the session's cache (session_cache_env)."""
    for name, value in session_cache_env(tmp_path_factory).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(autouse=True)
def _profiled_kernel_crossover_restored(monkeypatch):
    """A test whose saved profile is applied (use_profile, which every command that loads an
    engine calls) sets the int4 and int8 kernels' crossovers, and the row counts multiplied
    as W x^T, where a held copy's rows take a kernel, and the decode attention's path, for
    the process: the next test starts from the defaults again."""
    from flexgen_helm import dense_linear
    from flexgen_helm.compression import int4, int8
    from flexgen_helm.executor import attention

    for table in (int4.MAX_KERNEL_ROWS, int8.MAX_KERNEL_ROWS):
        for device_type, rows in table.items():
            monkeypatch.setitem(table, device_type, rows)
    monkeypatch.setattr(dense_linear, "FLIPPED_ROWS", dict(dense_linear.FLIPPED_ROWS))
    monkeypatch.setattr(int4, "KERNEL_OVER_KEPT_ROWS", dict(int4.KERNEL_OVER_KEPT_ROWS))
    monkeypatch.setitem(attention.FUSED_DECODE, "cpu", attention.FUSED_DECODE["cpu"])
    monkeypatch.setitem(attention.FUSED_PREFIX_PART, "cpu", attention.FUSED_PREFIX_PART["cpu"])


@pytest.fixture
def fake_helm_engine(monkeypatch):
    """The HELM plugin's engines are tests/helm_fake_engine.py's, with no policy, weights,
    device or offload directory from the environment; yields that module (LOADS emptied)."""
    pytest.importorskip("helm")
    import helm_fake_engine

    from flexgen_helm.helm import engines

    monkeypatch.setenv("FLEXGEN_HELM_ENGINE_FACTORY", "helm_fake_engine:load")
    for var in ("FLEXGEN_HELM_POLICY", "FLEXGEN_HELM_WEIGHTS_DIR", "FLEXGEN_HELM_DEVICE", "FLEXGEN_HELM_OFFLOAD_DIR"):
        monkeypatch.delenv(var, raising=False)
    engines.clear()
    helm_fake_engine.LOADS.clear()
    yield helm_fake_engine
    engines.clear()


@pytest.fixture
def small_fs(tmp_path):
    """make(nbytes) -> a folder on a new file system of that size (a tmpfs), for full-disk
    tests; they are skipped, with the reason, where this machine cannot mount one."""
    import subprocess

    mounted = []

    def make(nbytes: int) -> Path:
        where = tmp_path / f"small-fs-{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): "
                        f"{proc.stderr.strip() or proc.returncode}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def pinned_by_flags():
    """argv of the CLI's policy flags -> the policy fields they pin (cli/options.pinned_fields)."""
    import argparse

    from flexgen_helm.cli.options import add_policy_args, pinned_fields

    def pinned(argv: list[str]) -> dict:
        parser = argparse.ArgumentParser()
        add_policy_args(parser)
        return pinned_fields(parser.parse_args(argv))

    return pinned


def caches_holding_a_prefix(seed: int):
    """Five sequences' caches (2 kv heads) each holding the same 20-token prefix after its own
    padding, six positions of their own after it, and queries: (q, k, v, valid, prefix_k,
    prefix_v, starts)."""

    torch.manual_seed(seed)
    sequences, kvh, r, d, n = 5, 2, 3, 8, 20
    starts = torch.tensor([0, 3, 1, 2, 3])  # each row's padding, then its copy of the prefix
    t = int(starts.max()) + n + 6
    prefix_k, prefix_v = torch.randn(kvh, n, d), torch.randn(kvh, n, d)
    k, v = torch.randn(sequences * kvh, t, d), torch.randn(sequences * kvh, t, d)
    valid = torch.ones(sequences * kvh, t, dtype=torch.bool)
    for unit in range(sequences * kvh):
        s, h = int(starts[unit // kvh]), unit % kvh
        k[unit, s:s + n], v[unit, s:s + n], valid[unit, :s] = prefix_k[h], prefix_v[h], False
    valid[3, -2] = False  # a key a unit may not see after its prefix
    return torch.randn(sequences * kvh, r, 1, d), k, v, valid, prefix_k, prefix_v, starts


def mappings_of(path) -> int:
    """How many of this process's memory mappings are of the file at `path` (as /proc names it)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(real) for line in f)
