"""Model architecture as plain data, shared by every family."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about an architecture.

    `family` selects the math in `flexgen_helm.models.<family>`; the other fields
    are the usual transformer hyper-parameters.
    """

    family: str  # "opt" or "llama"
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    max_seq_len: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    # OPT
    word_embed_proj_dim: int = 0  # 0: hidden_size (opt-350m uses 512)
    do_layer_norm_before: bool = True
    # Llama family
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the checkpoint's rope_scaling
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k, v
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.word_embed_proj_dim == 0:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)
