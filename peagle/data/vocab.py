"""The draft vocabulary: the Vd target tokens the drafter predicts, and the maps between ids.

EAGLE-3 heads predict over a subset of the target vocabulary (the Vd tokens most frequent
at supervised positions of the training set). vLLM maps a draft id ``i`` back to the
target with offsets: ``target_id = i + d2t[i]``. ``t2d[v]`` says whether target token
``v`` is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from peagle.fileio import atomic_path
from peagle.layout import VOCAB_FILE  # noqa: F401 (re-exported: the data package's file name)


@dataclass(frozen=True)
class DraftVocab:
    draft_ids: torch.Tensor  # int64 [Vd], ascending target ids
    d2t: torch.Tensor  # int64 [Vd], target_id = i + d2t[i]
    t2d: torch.Tensor  # bool [V]

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        return draft_ids + self.d2t[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; -1 where the target token is not in the draft vocabulary."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.int64)
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        index[self.draft_ids] = torch.arange(self.size)
        return index[target_ids]

    def save(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            save_file({"draft_ids": self.draft_ids, "d2t": self.d2t, "t2d": self.t2d}, str(tmp))

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        t = load_file(str(path))
        return cls(draft_ids=t["draft_ids"], d2t=t["d2t"], t2d=t["t2d"])


def vocab_from_ids(draft_ids: torch.Tensor, vocab_size: int) -> DraftVocab:
    """A DraftVocab from a set of target ids (sorted here)."""
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.int64).unique(sorted=True)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return DraftVocab(draft_ids=draft_ids, d2t=draft_ids - torch.arange(draft_ids.numel()), t2d=t2d)


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent target tokens; ties go to the lower id.

    With ``draft_vocab_size == V`` every token is kept and ``d2t`` is all zeros.
    """
    counts = torch.as_tensor(token_counts, dtype=torch.int64)
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}] (the target vocabulary)")
    order = torch.argsort(-counts, stable=True)  # stable: equal counts stay in id order
    return vocab_from_ids(order[:draft_vocab_size], vocab_size)


def count_tokens(reader, vocab_size: int) -> torch.Tensor:
    """How often each target token appears at supervised (loss-masked) positions of a split."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for token_ids, loss_mask in reader.iter_tokens():
        if token_ids.numel() and int(token_ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(token_ids.max())} is outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(token_ids[loss_mask], minlength=vocab_size)
    return counts
