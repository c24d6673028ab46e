"""The target model: the embedded default (built offline, cached by recipe hash) or any hub/local model."""

from peagle.target.build import build_embedded_target, embedded_target_dir, recipe_hash
from peagle.target.resolve import load_target_config_and_tokenizer, resolve_target

__all__ = [
    "build_embedded_target",
    "embedded_prompt_messages",
    "embedded_target_dir",
    "load_target_config_and_tokenizer",
    "recipe_hash",
    "resolve_target",
    "write_prompt_files",
]


def __getattr__(name: str):
    # Imported lazily so `python -m peagle.target.prompts` does not import itself twice.
    if name in ("embedded_prompt_messages", "write_prompt_files"):
        from peagle.target import prompts

        return getattr(prompts, name)
    raise AttributeError(f"module 'peagle.target' has no attribute {name!r}")
