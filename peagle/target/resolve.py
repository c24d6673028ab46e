"""Turn ``target.model`` into something transformers and vLLM can load, failing clearly."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from peagle.config import DEMO_TARGET_LINE, ConfigError, TargetConfig
from peagle.target.embedded import BUILD_COMMAND, embedded_target_dir, is_complete


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1


def resolve_target(target: TargetConfig) -> str:
    """``embedded`` -> the tiny test target's build; a local path -> that path; else the hub id."""
    if target.is_embedded:
        return str(embedded_test_target(target))
    local = Path(target.model).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"target.model {target.model!r} is a local path without a config.json")
        return str(local.resolve())
    if _looks_like_path(target.model):
        raise ConfigError(f"target.model {target.model!r} looks like a local path but does not exist")
    try:
        validate_repo_id(target.model)
    except HFValidationError:
        raise ConfigError(
            f"target.model {target.model!r} is neither an existing local directory nor a valid hub id "
            "(org/name); fix the path or the id"
        ) from None
    require_cached_when_offline(target)
    return target.model


def embedded_test_target(target: TargetConfig) -> Path:
    """The built directory of the tiny test target's recipe, or a ``ConfigError`` saying how to
    build it (test scaffolding: the test suite builds it, a run never does)."""
    path = embedded_target_dir(target.embedded)
    if not is_complete(path):
        raise ConfigError(f"target.model: embedded is the tiny test target, and its recipe's build is not in {path}: "
                          f"build it with `{BUILD_COMMAND}` (the test suite does), or point target.model at a model "
                          f"(configs/demo.yaml's: `target: {{model: {DEMO_TARGET_LINE}}}`)")
    return path


def require_cached_when_offline(target: TargetConfig) -> None:
    """With the hub off (HF_HUB_OFFLINE), a hub id must be in the local Hugging Face cache (its
    config.json at ``target.revision``); a ``ConfigError`` naming the cache and the fix otherwise."""
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    if not is_offline_mode():
        return
    if isinstance(try_to_load_from_cache(target.model, "config.json", revision=target.revision), str):
        return
    at = f" at revision {target.revision}" if target.revision else ""
    raise ConfigError(
        f"target.model {target.model!r}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
        f"hub is off (HF_HUB_OFFLINE=1): download it once where the hub is reachable (`hf download "
        f"{target.model}{f' --revision {target.revision}' if target.revision else ''}`), or point target.model at "
        "a local directory holding the model"
    )


def load_target_config_and_tokenizer(target: TargetConfig) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The target's transformers config and tokenizer (revision / trust_remote_code from the config)."""
    where = resolve_target(target)
    kwargs = {"revision": target.revision, "trust_remote_code": target.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(where, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except OSError as err:  # hub errors (offline, gated, missing repo) arrive as OSError subclasses
        reason = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"target.model {target.model!r} (revision {target.revision or 'default'}) could not be reached: "
            f"{reason}. If it is a gated or private hub model set HF_TOKEN (and unset HF_HUB_OFFLINE); on a host "
            f"without the hub, download it once where the hub is reachable (`hf download {target.model}`) and set "
            "HF_HUB_OFFLINE=1, or point target.model at a local directory with the model"
        ) from None
    return config, tokenizer
