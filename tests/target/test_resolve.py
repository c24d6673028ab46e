"""A target the config names but this host cannot read is refused with the command that fetches it."""

from __future__ import annotations

import pytest

from peagle.config import ConfigError, TargetConfig
from peagle.target import load_target_config_and_tokenizer
from peagle.target.resolve import require_cached_when_offline


def test_an_uncached_hub_target_with_the_hub_off_names_the_download_with_its_revision(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the suite's own setting, said here
    with pytest.raises(ConfigError) as info:
        require_cached_when_offline(TargetConfig(model="acme/not-cached", revision="abc123"))
    message = str(info.value)
    assert "'acme/not-cached' at revision abc123 is not in the Hugging Face cache" in message
    assert "(`hf download acme/not-cached --revision abc123`)" in message


def test_a_local_target_without_its_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is a local path without a config.json"):
        load_target_config_and_tokenizer(TargetConfig(model=str(tmp_path)))
