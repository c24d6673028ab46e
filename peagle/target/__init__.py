"""The target model: any hub or local model ``target.model`` names, a GGUF import, or the tiny
``embedded`` test target once built (``peagle.target.embedded``)."""

from peagle.target.embedded import embedded_target_dir, recipe_hash
from peagle.target.resolve import load_target_config_and_tokenizer, resolve_target

__all__ = [
    "embedded_target_dir",
    "load_target_config_and_tokenizer",
    "recipe_hash",
    "resolve_target",
]
