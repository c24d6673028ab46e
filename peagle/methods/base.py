"""What a drafting method does: the behaviour training, offline evaluation and export ask of it.

What a method is (its names, parallel drafting, its own ``train`` fields, the tensors its head
leaves out, its card's text) is its torch-free ``peagle.catalogue.MethodDescription``; what it
does, for a head it trains: how it is trained (``objective``) and how a fresh drafter is set up
for it (``prepare_drafter``), how it drafts offline (``draft``), the tensors its head ships
beyond the EAGLE-3 contract (``head_tensors``) and its card's training facts. Subclass
``DraftingMethod`` (or an existing method) and override what differs; ``peagle.methods.METHODS``
maps names to methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from peagle.catalogue import MethodDescription
from peagle.contract import TensorRule
from peagle.facts import HeadSpec
from peagle.objective import Objective
from peagle.objective.batch import Batch


def starts_from_trained_rows(spec: HeadSpec, train) -> bool:
    """Whether a fresh drafter's embeddings and lm_head hold trained rows (the target's, or a
    warm start's head), so a recipe may freeze them; a narrower drafter's start random."""
    return spec.as_wide_as_target or bool(train.init_from)


class DraftingMethod:
    """One drafting method's behaviour; ``description`` says what it is."""

    description: MethodDescription

    @property
    def name(self) -> str:
        return self.description.name

    def objective(self, train, spec: HeadSpec, target_head) -> Objective:
        """How ``train`` trains a drafter for ``spec`` against the frozen ``target_head``."""
        raise NotImplementedError(f"{self.name}: no training objective")

    def prepare_drafter(self, drafter, train) -> None:
        """Set up a freshly built drafter for training with ``train``: which of its parameters
        train and how the method's own ones start (before any warm start loads over them)."""

    def draft(
        self, drafter, batch: Batch, k: int, to_target_ids: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Offline drafting: (anchor, depth, target token id) of every draft vLLM would make.

        ``batch`` (``peagle.eval.offline``) holds depth 0 for the context and depths
        1..k-1 (mask token, ``is_mask``) for the ``supervised`` anchors that draft.
        """
        raise NotImplementedError(f"{self.name}: no offline drafting")

    def head_tensors(self, spec: HeadSpec) -> dict[str, TensorRule]:
        """Tensors the head ships beyond the EAGLE-3 contract (``peagle.contract``)."""
        return {}

    def card_training(self, train, spec: HeadSpec) -> dict[str, str]:
        """The model card's training facts that belong to this method (``spec``: the head trained)."""
        return {"method": self.description.display_name}

    def __repr__(self) -> str:
        return f"<drafting method {self.name!r}>"
