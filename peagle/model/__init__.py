"""The drafter (nn.Module) with vLLM's weight names; no data, no training."""

from peagle.model.drafter import DrafterOutput, PEagleDrafter, RMSNorm
from peagle.model.target_weights import TargetWeightsError, load_target_tensors, target_config

__all__ = [
    "DrafterOutput",
    "PEagleDrafter",
    "RMSNorm",
    "TargetWeightsError",
    "load_target_tensors",
    "target_config",
]
