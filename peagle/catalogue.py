"""The drafting methods peagle trains, described without torch: one ``MethodDescription`` each.

A description says what a method is: its names, whether vLLM drafts with it in parallel, the
drafter weights its head leaves out, its block of ``train`` (``train.peagle``: the knobs only its
kind reads), the field of that block that bounds the K it is evaluated at and the one that sets
its drafter's depth, and its model card's text. Config validation, a head's identity, the
dataset's facts and every stage read these; what a method does (its training objective, offline
drafting, its head's own tensors) is its behaviour in ``peagle.methods``, which imports torch and
sits above the stages.

Adding a method is its description here (in ``DESCRIPTIONS``), its block of ``train`` (a field of
``peagle.config.TrainConfig``, or the block of a method it varies) and its behaviour, a package
under ``peagle/methods/`` whose ``DraftingMethod`` subclass ``peagle.methods.METHODS`` names.
"""

from __future__ import annotations

from dataclasses import dataclass

# The method of a head when none is named (train.method's default).
DEFAULT_METHOD = "peagle"
# The method train.baseline.eagle3 trains beside the head, on the same data.
BASELINE = "eagle3"


@dataclass(frozen=True)
class MethodDescription:
    """What a drafting method is, as config validation and every stage read it."""

    name: str  # train.method, the checkpoint and head directory names
    label: str  # results are keyed by it (online rows, MLflow metrics, registry tag)
    display_name: str  # what people read (model card, tables)
    parallel_drafting: bool  # vLLM's speculative config flag: K drafts in one forward pass
    train_block: str  # its block of the train section (train.<train_block>): the knobs only its kind reads
    omitted_tensors: frozenset[str] = frozenset()  # drafter weights its head must not ship
    eval_k_field: str | None = None  # its block's field bounding the K a head is evaluated at (None: any K)
    num_layers_field: str | None = None  # its block's field setting its drafter's depth (unset: drafter.num_layers)
    card_summary: str = ""  # the model card's first paragraph
    card_serve_note: str = ""  # the line under the card's serve command
    card_tags: tuple[str, ...] = ("speculative-decoding", "eagle3")

    def own(self, train):
        """This method's block of the train section ``train`` (``train.<train_block>``)."""
        return getattr(train, self.train_block)

    def max_eval_k(self, trained) -> int | None:
        """The largest K a head can be evaluated at, offline and served in the evaluation (None:
        any); ``trained`` is this method's block of the train section it trains with (``own``) or
        the ``HeadSpec`` of a checkpoint (both hold ``eval_k_field``). ``eval.ks`` beyond it is
        refused when the config loads."""
        return getattr(trained, self.eval_k_field) if self.eval_k_field else None

    def num_layers(self, cfg) -> int:
        """Decoder layers of this method's drafter under ``cfg``."""
        own = getattr(self.own(cfg.train), self.num_layers_field) if self.num_layers_field else None
        return own or cfg.drafter.num_layers

    def __repr__(self) -> str:
        return f"<drafting method {self.name!r}>"


PEAGLE = MethodDescription(
    name="peagle",
    label="p-eagle",
    display_name="P-EAGLE",
    parallel_drafting=True,
    train_block="peagle",
    # served with parallel drafting at any K, but evaluated offline only at the depths it trained
    eval_k_field="k_train",
    card_summary=("A P-EAGLE (parallel-drafting EAGLE-3) speculative-decoding head: it proposes K draft "
                  "tokens in one forward pass. Trained with peagle."),
    card_serve_note="P-EAGLE needs vLLM's V1 model runner (the V2 runner drafts sequentially).",
    card_tags=("speculative-decoding", "eagle3", "p-eagle", "parallel-drafting"),
)

EAGLE3 = MethodDescription(
    name="eagle3",
    label="eagle-3",
    display_name="EAGLE-3",
    parallel_drafting=False,
    train_block="eagle3",
    # untrained here; shipping it would let vLLM serve the head with parallel drafting (the name is
    # peagle.contract.MASK_HIDDEN, which sits above this module; tests/methods checks they agree)
    omitted_tensors=frozenset({"mask_hidden"}),
    num_layers_field="num_layers",
    card_summary=("An EAGLE-3 speculative-decoding head (one draft token per forward pass), trained with "
                  "peagle on the same data as its P-EAGLE sibling for comparison. Serve it WITHOUT parallel "
                  "drafting."),
    card_serve_note="No mask_hidden is shipped: parallel drafting is not available for this head.",
)

DESCRIPTIONS: dict[str, MethodDescription] = {d.name: d for d in (PEAGLE, EAGLE3)}


def available_methods() -> list[str]:
    """Names ``train.method`` accepts."""
    return sorted(DESCRIPTIONS)


def describe(name: str) -> MethodDescription:
    """The description of the method named ``name``; an unknown name is refused with the known ones."""
    if name not in DESCRIPTIONS:
        raise ValueError(f"unknown drafting method {name!r}; available: {', '.join(available_methods())}")
    return DESCRIPTIONS[name]


def trained_methods(train) -> list[MethodDescription]:
    """The methods a pipeline run trains: ``train.method``'s, then the EAGLE-3 baseline when
    ``train.baseline.eagle3`` asks for it (and the head is not EAGLE-3 itself)."""
    head = describe(train.method)
    return [head] if not train.baseline.eagle3 or head.name == BASELINE else [head, describe(BASELINE)]


__all__ = [
    "BASELINE",
    "DEFAULT_METHOD",
    "DESCRIPTIONS",
    "EAGLE3",
    "PEAGLE",
    "MethodDescription",
    "available_methods",
    "describe",
    "trained_methods",
]
