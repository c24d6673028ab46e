"""Publishing heads: the vLLM head directory, its validator and its model card."""

from peagle.export.card import ModelCardInfo, render_model_card, serve_command
from peagle.export.head import ExportError, VocabMaps, export_from_checkpoint, export_head, load_vocab
from peagle.export.validate import HeadValidationError, ValidationReport, validate_head

__all__ = [
    "ExportError",
    "HeadValidationError",
    "ModelCardInfo",
    "ValidationReport",
    "VocabMaps",
    "export_from_checkpoint",
    "export_head",
    "load_vocab",
    "render_model_card",
    "serve_command",
    "validate_head",
]
