"""The text a calibrated quantizer (GPTQ) sees: sampled from the unquantized model itself.

No text can be downloaded here, and the two evaluation sets (LAMBADA, WikiText-2) must not
calibrate what they then measure; so, as in data-free quantization-aware training
(LLM-QAT, Liu et al., 2023), each calibration sequence is sampled from the model in the
CPU's compute dtype (engine.weight_calibration) at temperature 1 (no top-k or top-p: its own
distribution), starting from its beginning-of-text token (its end-of-text token where it
has none: the document separator it was trained with), each sequence from a fixed seed of
its own: the same model gives the same text on every run. Sequences run on past an
end-of-text token into a new document.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models.config import ModelConfig


@dataclass(frozen=True)
class CalibrationText:
    """How much text is sampled, and how (module doc)."""

    sequences: int = 16
    length: int = 128  # tokens per sequence, the start token included; at most the model's context
    temperature: float = 1.0
    seed: int = 0  # sequence i samples with seed + i

    def settings(self) -> dict:
        return asdict(self)

    def tokens_per_sequence(self, cfg: ModelConfig) -> int:
        return min(self.length, cfg.max_seq_len)

    def requests(self, cfg: ModelConfig) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompts (the start token alone) and sampling parameters for the engine's generate."""
        start = cfg.document_start_token
        if start is None:
            raise FlexGenError(f"{cfg.name} names neither a beginning- nor an end-of-text token: calibration "
                               "text has no start to be sampled from")
        new = self.tokens_per_sequence(cfg) - 1
        params = [SamplingParams(max_new_tokens=new, temperature=self.temperature, seed=self.seed + i,
                                 ignore_eos=True) for i in range(self.sequences)]
        return [[start] for _ in range(self.sequences)], params
