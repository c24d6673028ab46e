"""``python -m peagle.testing.embedded [--config CONFIG] [--force]``: build (or reuse) the tiny
test target of a config's ``target.embedded`` recipe and print where it is and its build report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peagle.config import EmbeddedTargetRecipe, load_config
from peagle.target.embedded import REPORT_NAME
from peagle.testing.embedded.build import build_embedded_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].strip("`"))
    parser.add_argument("--config", type=Path, default=None,
                        help="a config whose target.embedded recipe to build (default: the default recipe)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    args = parser.parse_args()
    recipe = load_config(args.config).target.embedded if args.config else EmbeddedTargetRecipe()
    path = build_embedded_target(recipe, force=args.force)
    print(f"target: {path}")
    print(json.dumps(json.loads((path / REPORT_NAME).read_text()), indent=2))


if __name__ == "__main__":
    main()
