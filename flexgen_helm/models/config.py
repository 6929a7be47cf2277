"""Model architecture as plain data, shared by every family."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about an architecture.

    `family` selects the math in `flexgen_helm.models.<family>`; the other fields
    are the usual transformer hyper-parameters.
    """

    family: str  # a key of flexgen_helm.models.FAMILIES: "opt", "llama", "gemma", "phi3", "moe"
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
    # Llama family (and Gemma, Phi-3)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # sorted (key, value) pairs of the checkpoint's rope_scaling (lists as tuples: LongRoPE's factors)
    rope_scaling: tuple = ()
    rotary_dims: int = 0  # 0: head_dim; fewer: only the first rotary_dims of each head rotate
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k, v
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's query and key
    mlp_activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    # Attention, per block: sliding_windows[i] = w > 0 lets block i attend to its last w positions
    # (itself included), and its KV cache holds only those; 0 (or an empty tuple) attends to all.
    sliding_windows: tuple = ()
    query_scale: float = 0.0  # scores are q.k * query_scale; 0: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # Gemma 2: logits likewise
    local_rope_theta: float = 0.0  # Gemma 3: rotary base of the sliding-window blocks (unscaled)
    # Mixture of experts (family "moe": Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss): a block's MLP is
    # num_experts gated MLPs of expert_ffn_size, each token through the experts_per_token its
    # router's softmax ranks highest, their outputs summed with those probabilities (renormalised
    # to sum to one where norm_topk_prob; multiplied in float32 where routing_in_float: Mixtral)
    moe_type: str = ""  # transformers' model_type ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_size: int = 0
    norm_topk_prob: bool = False
    routing_in_float: bool = False
    shared_expert_ffn_size: int = 0  # Qwen2-MoE: a gated MLP every token takes, scaled by sigmoid(a gate)
    dense_blocks: tuple = ()  # blocks whose MLP is the dense one of ffn_size (Qwen's mlp_only_layers)
    qk_norm_whole: bool = False  # OLMoE: the q/k norms span the whole projection, not each head
    clip_qkv: float = 0.0  # OLMoE: q, k and v clamped to [-clip, clip]; 0: not
    # gpt-oss: a learned logit per query head ("sinks") joins each softmax's denominator and adds no value
    attention_sinks: bool = False
    output_bias: bool = False  # gpt-oss: o_proj has a bias (beside q, k, v's: attention_bias)
    # gpt-oss: router and experts with biases; the router's top k logits, then a softmax over those k alone
    mlp_bias: bool = False
    softmax_after_topk: bool = False
    # gpt-oss's experts: gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha *
    # gate) (its interleaved gate_up_proj split at conversion); 0: the plain gated MLP of mlp_activation
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
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

    @property
    def document_start_token(self) -> int | None:
        """The token a document starts after when nothing precedes it: the beginning-of-text
        token, else the end-of-text token (the separator the model was trained with between
        documents); None when the model names neither."""
        return self.bos_token_id if self.bos_token_id is not None else self.eos_token_id

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def sparse_block(self, block: int) -> bool:
        """Whether block `block`'s MLP is the experts (not a dense MLP)."""
        return self.is_moe and block not in self.dense_blocks

    def window(self, block: int) -> int:
        """The sliding window of block `block` (0: it attends to every earlier position)."""
        return self.sliding_windows[block] if self.sliding_windows else 0
