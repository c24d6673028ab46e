"""EAGLE-3: the same head trained autoregressively with training-time test (TTT), one draft per pass.

EAGLE-3 drafts one token per forward pass. vLLM (``llm_base_proposer.py``, non-parallel
path) runs step 0 on the accepted context, (x_{p+1}, fc(g_p)) at position p, then each
step j >= 1 feeds ONE new slot at position p + j: the token drafted at step j-1 and, as
its hidden state, the drafter's own pre-final-norm output of step j-1 (``prenorm``,
``DrafterOutput.hidden``; it bypasses ``fc``). Its query sees the context up to p and the
earlier steps of its own chain through the KV cache.

Training-time test reproduces that: element (p, j) of a P-EAGLE-layout example is step j
after anchor p. Choices (as in the EAGLE-3 paper's TTT): the token fed at step j >= 1 is
the ground-truth x_{p+j+1}, not the drafted one; gradients flow through the fed-back
hidden states; the RoPE position of step j is p + j (vLLM's); attention is P-EAGLE's rule
(depth-0 context up to the anchor, plus the own chain), i.e. exactly the KV cache view.
Step j is one forward pass over every element of depth <= j; the shallower elements are
recomputed with the same inputs, which gives the same values as cached keys/values.

Loss: the P-EAGLE objective's KL and weighting over all charged (anchor, step) elements.
The exported head uses the same weight names; ``mask_hidden`` stays untrained (served
WITHOUT ``parallel_drafting``).

Reading the metrics: ``acc/depth_j`` (j >= 1) averages over EVERY anchor, including those
whose step j-1 was wrong; acceptance at draft position j+1 is the accuracy over the anchors
whose steps 0..j-1 were right (on those, drafting feeds exactly these inputs:
``tests/eval/test_offline.py``). The two differ a lot early in training: the fed-back
hidden state is layer 0's residual, so a barely trained head mostly repeats its parent's
draft, which scores at depth j mostly where step j-1 was wrong. Such a head logs a fair
acc/depth_1 yet accepts almost nothing at position 2.
"""

from __future__ import annotations

from functools import partial

import torch

from peagle.catalogue import EAGLE3
from peagle.facts import HeadSpec
from peagle.methods.base import DraftingMethod, starts_from_trained_rows
from peagle.methods.eagle3.examples import build_eagle3_example
from peagle.methods.eagle3.loss import eagle3_loss
from peagle.methods.eagle3.ttt import ttt_passes
from peagle.objective import Objective
from peagle.objective.batch import Batch, collate
from peagle.objective.loss import LossOutput, TargetHead
from peagle.objective.masks import PrecomputedMask


class Eagle3(DraftingMethod):
    description = EAGLE3

    def objective(self, train, spec: HeadSpec, target_head: TargetHead) -> Objective:
        """Training-time test over ``train.eagle3.ttt_steps`` steps, no COD subsampling."""
        steps = train.eagle3.ttt_steps

        def make_example(sample, generator):
            return build_eagle3_example(sample, spec, steps, train.recipe.max_len)

        def loss(model, batch: Batch, denominator) -> LossOutput:
            return eagle3_loss(model, target_head, batch, steps, train.recipe.loss_depth_weighting, denominator, k=steps,
                               unaccepted_weight=train.recipe.unaccepted_weight, kind=train.recipe.loss)

        return Objective(
            name=self.name,
            make_example=make_example,
            collate=partial(collate, mask=PrecomputedMask(train.recipe.max_len, steps)),
            loss=loss,
            depths=steps,
            weighting=train.recipe.loss_depth_weighting,
        )

    def prepare_drafter(self, drafter, train) -> None:
        """The embedding table stays frozen, as EAGLE-3's reference trainers keep it: every token
        it embeds is a real one, already embedded by the target. lm_head trains. (On a real
        vocabulary the table is most of the drafter: SmolLM2's 28M of 37M values.) A drafter
        narrower than its target starts with a random table, which must train unless a warm
        start brings a trained one."""
        if starts_from_trained_rows(drafter.spec, train):
            drafter.embed_tokens.weight.requires_grad_(False)

    def draft(self, drafter, batch, k, to_target_ids):
        """K passes, each step fed its parent's drafted token and pre-norm hidden state (vLLM's)."""
        anchor, depth, tokens = [], [], []
        for st in ttt_passes(drafter, batch, k, to_target_ids=to_target_ids):
            anchor.append(st.batch.anchor[st.logits_mask])
            depth.append(st.batch.depth[st.logits_mask])
            tokens.append(to_target_ids(st.output.logits.argmax(-1)))
        return torch.cat(anchor), torch.cat(depth), torch.cat(tokens)

    def card_training(self, train, spec) -> dict[str, str]:
        if train.init_from:
            trained = "all but the embedding table (the warm start head's)"
        elif starts_from_trained_rows(spec, train):
            trained = "all but the embedding table (the target's)"
        else:
            trained = "all (the embedding table too: this drafter is narrower than its target and started it random)"
        return {"method": "EAGLE-3 (training-time test)", "TTT steps": str(train.eagle3.ttt_steps),
                "trained parameters": trained}


METHOD = Eagle3()
