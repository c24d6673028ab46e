"""P-EAGLE: K draft tokens in one forward pass (mask token + learned ``mask_hidden``).

Training: every anchor's depth 0 plus COD-sampled depths 1..k_train-1 of mask slots, one
pass, forward KL to the target (the shared layout of ``peagle.objective.batch``, the loss of
``peagle.methods.peagle.loss``). Drafting: one pass of that layout without COD subsampling. The head ships ``mask_hidden``; vLLM
serves it with ``parallel_drafting``, at any K, but it is only evaluated offline at the
depths it was trained for (K <= k_train).
"""

from __future__ import annotations

from functools import partial

from peagle.catalogue import PEAGLE
from peagle.contract import TensorRule, fc_input_size
from peagle.methods.base import DraftingMethod, starts_from_trained_rows
from peagle.methods.peagle.loss import one_pass, peagle_loss
from peagle.objective import Objective
from peagle.objective.batch import build_peagle_example, collate
from peagle.objective.loss import Depth0Share
from peagle.objective.masks import PrecomputedMask


class PEagle(DraftingMethod):
    description = PEAGLE

    def objective(self, train, spec, target_head) -> Objective:
        share = train.peagle.depth0_loss_share if train.recipe.loss_depth_weighting == "uniform" else None
        weighting = Depth0Share(share) if share is not None else train.recipe.loss_depth_weighting

        def make_example(sample, generator):
            return build_peagle_example(
                sample, spec, train.peagle.k_train, train.peagle.cod_ratio, train.peagle.cod_floor, train.recipe.max_len,
                generator, mask_slot_inputs=train.peagle.mask_slot_inputs,
            )

        def loss(model, batch, denominator):
            return peagle_loss(model, target_head, batch, weighting, denominator, k=train.peagle.k_train,
                               unaccepted_weight=train.recipe.unaccepted_weight, kind=train.recipe.loss)

        return Objective(
            name=self.name,
            make_example=make_example,
            collate=partial(collate, mask=PrecomputedMask(train.recipe.max_len, train.peagle.k_train)),
            loss=loss,
            depths=train.peagle.k_train,
            weighting=weighting,
        )

    def prepare_drafter(self, drafter, train) -> None:
        """The recipe's trainable set and ``mask_hidden``'s scale (``bench/quality.py`` measures them).

        Freezing lm_head / the embeddings keeps the target's own rows, so it needs a drafter
        that starts from them: as wide as the target, or warm started from a head.
        """
        spec = drafter.spec
        frozen = [name for name, on in (
            ("train.peagle.freeze_lm_head: true", train.peagle.freeze_lm_head),
            ("train.peagle.train_embeddings: mask_row", train.peagle.train_embeddings == "mask_row"),
        ) if on]
        if frozen and not starts_from_trained_rows(spec, train):
            raise ValueError(
                f"{' and '.join(frozen)} keep the target's weights, but this drafter is {spec.hidden_size} wide "
                f"and the target {spec.target_hidden_size}, so they start random: set train.peagle.freeze_lm_head: false "
                "and train.peagle.train_embeddings: all, or drafter.hidden_size to the target's"
            )
        drafter.init_mask_hidden(train.peagle.mask_hidden_init_std)
        if train.peagle.freeze_lm_head:
            drafter.lm_head.requires_grad_(False)
        if train.peagle.train_embeddings == "mask_row":
            drafter.train_mask_row_only()

    def draft(self, drafter, batch, k, to_target_ids):
        out = one_pass(drafter, batch)
        picked = batch.supervised
        return batch.anchor[picked], batch.depth[picked], to_target_ids(out.logits.argmax(-1))

    def head_tensors(self, spec):
        return {"mask_hidden": TensorRule((1, 1, fc_input_size(spec)), "float", "h_shared, pre-fc space")}

    def card_training(self, train, spec) -> dict[str, str]:
        trained = "all but lm_head" if train.peagle.freeze_lm_head else "all"
        if train.peagle.train_embeddings == "mask_row":
            trained += " (embeddings: the mask row only)"
        return {"method": self.description.display_name, "K_train": str(train.peagle.k_train),
                "COD ratio": str(train.peagle.cod_ratio), "trained parameters": trained}


METHOD = PEagle()
