"""The demo's prompt files, made from the same stdlib split the embedded target uses.

``code_train.jsonl`` holds functions of TRAIN-split files, ``code_eval.jsonl`` functions of
HELD-OUT files (never seen by the target). Each line is
``{"id", "messages": [user: signature + docstring, assistant: the original function]}``;
the assistant turn is a reference that regeneration replaces with the target's answer.
``code_completion_{train,eval}.jsonl`` are completion traffic on the same functions:
``{"id", "text": signature + docstring}``, raw code the target continues with no chat
template (``schema: text`` sources, ``eval.completion_prompts``). Regenerate with ``python -m peagle.testing.embedded.prompts``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

from peagle.config import EmbeddedTargetRecipe
from peagle.fileio import atomic_open
from peagle.paths import REPO_ROOT
from peagle.testing.embedded.corpus import _hash_unit, chat_examples, load_corpus

PROMPTS_DIR = REPO_ROOT / "data" / "prompts"
DEFAULT_COUNTS = {"train": 2000, "eval": 64}
FILE_NAMES = {"train": "code_train.jsonl", "eval": "code_eval.jsonl"}
COMPLETION_FILE_NAMES = {"train": "code_completion_train.jsonl", "eval": "code_completion_eval.jsonl"}
GENERATED_WITH_PYTHON = "3.11.7"  # the stdlib the committed files were made from


def embedded_prompt_messages(
    split: Literal["train", "eval"], count: int, recipe: EmbeddedTargetRecipe | None = None
) -> list[dict]:
    """``count`` prompt records from the recipe's train or held-out files, in a stable order."""
    return [{"id": ex.id, "messages": ex.messages()} for ex in _examples(split, count, recipe)]


def completion_record(example) -> dict:
    """A function as completion traffic: its def line(s) and docstring, which the target continues."""
    return {"id": example.id, "text": f"{example.head}\n"}


def _examples(split: Literal["train", "eval"], count: int, recipe: EmbeddedTargetRecipe | None = None) -> list:
    recipe = recipe or EmbeddedTargetRecipe()
    corpus = load_corpus(recipe.corpus_max_bytes, recipe.heldout_fraction, recipe.seed)
    files = corpus.train if split == "train" else corpus.heldout
    examples = sorted(chat_examples(files), key=lambda ex: _hash_unit(f"prompt:{recipe.seed}:{ex.id}"))
    if len(examples) < count:
        raise ValueError(f"only {len(examples)} {split} functions are available, {count} were asked for")
    return examples[:count]


def write_prompt_files(out_dir: Path = PROMPTS_DIR, counts: dict[str, int] | None = None) -> dict[str, Path]:
    """Write the prompt files atomically (each split's functions also as completion traffic);
    returns their paths."""
    counts = {**DEFAULT_COUNTS, **(counts or {})}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, name in FILE_NAMES.items():
        examples = _examples(split, counts[split])
        written[split] = _write_jsonl(out_dir / name, [{"id": ex.id, "messages": ex.messages()} for ex in examples])
        written[f"completion_{split}"] = _write_jsonl(out_dir / COMPLETION_FILE_NAMES[split],
                                                      [completion_record(ex) for ex in examples])
    return written


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    with atomic_open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=PROMPTS_DIR)
    parser.add_argument("--train", type=int, default=DEFAULT_COUNTS["train"])
    parser.add_argument("--eval", type=int, default=DEFAULT_COUNTS["eval"])
    args = parser.parse_args()
    for split, path in write_prompt_files(args.out_dir, {"train": args.train, "eval": args.eval}).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
