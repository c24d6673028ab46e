"""The drafter (nn.Module) with vLLM's weight names; no data, no training."""

from peagle.model.drafter import (
    DrafterOutput,
    ElementRule,
    PEagleDrafter,
    RMSNorm,
    attention_backend,
    check_attention_backend,
)
from peagle.model.target_weights import TargetWeightsError, load_target_tensors, target_config

__all__ = [
    "DrafterOutput",
    "ElementRule",
    "PEagleDrafter",
    "RMSNorm",
    "TargetWeightsError",
    "attention_backend",
    "check_attention_backend",
    "load_target_tensors",
    "target_config",
]
