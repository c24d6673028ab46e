"""What a drafting method is: the questions every stage asks it.

A method answers, for a head it trains: its name and labels, whether vLLM drafts with it in
parallel (``parallel_drafting``), how it is trained (``objective``), how it drafts offline
(``draft``), the largest K it can be evaluated at, the tensors its head ships beyond the
EAGLE-3 contract and the drafter weights it leaves out, the ``train`` fields only it reads,
and what its model card says. Subclass ``DraftingMethod`` (or an existing method) and
override what differs; ``peagle.methods`` lists the methods by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing a method must stay cheap: config validation lists them
    from collections.abc import Callable

    import torch

    from peagle.contract import TensorRule
    from peagle.facts import HeadSpec
    from peagle.objective import Objective
    from peagle.objective.batch import Batch


def starts_from_trained_rows(spec: HeadSpec, train) -> bool:
    """Whether a fresh drafter's embeddings and lm_head hold trained rows (the target's, or a
    warm start's head), so a recipe may freeze them; a narrower drafter's start random."""
    return spec.as_wide_as_target or bool(train.init_from)


class DraftingMethod:
    """One drafting method; class attributes say what it is, methods what it does."""

    name: str  # train.method, the checkpoint and head directory names
    label: str  # results are keyed by it (online rows, MLflow metrics, registry tag)
    display_name: str  # what people read (model card, tables)
    parallel_drafting: bool  # vLLM's speculative config flag: K drafts in one forward pass
    own_train_fields: frozenset[str] = frozenset()  # train.* fields no other method reads
    omitted_tensors: frozenset[str] = frozenset()  # drafter weights its head must not ship
    card_summary: str = ""  # the model card's first paragraph
    card_serve_note: str = ""  # the line under the card's serve command
    card_tags: tuple[str, ...] = ("speculative-decoding", "eagle3")

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

    def max_eval_k(self, train) -> int | None:
        """The largest K a head trained with ``train`` can be evaluated at, offline and served in the
        evaluation (None: any); ``eval.ks`` beyond it is refused when the config loads."""
        return None

    def head_tensors(self, spec: HeadSpec) -> dict[str, TensorRule]:
        """Tensors the head ships beyond the EAGLE-3 contract (``peagle.contract``)."""
        return {}

    def num_layers(self, cfg) -> int:
        """Decoder layers of this method's drafter under ``cfg`` (``drafter.num_layers`` unless the
        method has a depth of its own)."""
        return cfg.drafter.num_layers

    def card_training(self, train, spec: HeadSpec) -> dict[str, str]:
        """The model card's training facts that belong to this method (``spec``: the head trained)."""
        return {"method": self.display_name}

    def __repr__(self) -> str:
        return f"<drafting method {self.name!r}>"
