"""A registry whose champion was trained on exactly a config's inputs: what `peagle retrain`
must leave alone ("nothing new"), without training a head first."""

from __future__ import annotations

from pathlib import Path

NAME = "peagle-embedded"


def register_champion_trained_on(cfg, tracking_uri: str, source: Path, name: str = NAME) -> str:
    """Register version 1 of ``name`` tagged with ``cfg``'s lineage and alias it champion; returns the version."""
    from mlflow import MlflowClient

    from peagle.lineage import LINEAGE_PREFIX, lineage
    from peagle.stages import prepare_target

    client = MlflowClient(tracking_uri=tracking_uri)
    client.create_registered_model(name)
    version = client.create_model_version(name, source=str(source))
    for key, value in lineage(cfg, prepare_target(cfg)).items():
        client.set_model_version_tag(name, version.version, LINEAGE_PREFIX + key, value)
    client.set_registered_model_alias(name, "champion", version.version)
    return version.version
