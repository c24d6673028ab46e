"""Where the tiny ``embedded`` test target lives once built: a directory under
``PEAGLE_HOME/targets`` named by the hash of its recipe (``target.embedded``) and build version.

The build itself is test scaffolding (``peagle.testing.embedded``: ``python -m
peagle.testing.embedded``); a run that names ``target.model: embedded`` reads what it built.
"""

from __future__ import annotations

from pathlib import Path

from peagle.config import EmbeddedTargetRecipe
from peagle.fileio import json_digest
from peagle.paths import peagle_home

# Bump when the build changes what a recipe produces (it is part of the cache key).
BUILD_VERSION = "1"
REPORT_NAME = "build_report.json"  # written last by the build: its directory is complete
BUILD_COMMAND = "python -m peagle.testing.embedded"


def recipe_hash(recipe: EmbeddedTargetRecipe) -> str:
    return json_digest({"recipe": recipe.model_dump(mode="json"), "build": BUILD_VERSION}, 12)


def embedded_target_dir(recipe: EmbeddedTargetRecipe) -> Path:
    return peagle_home() / "targets" / f"embedded-{recipe_hash(recipe)}"


def is_complete(path: Path) -> bool:
    return (path / REPORT_NAME).is_file()
