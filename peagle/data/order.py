"""The order a training split is read in: one permutation per epoch, seeded by (seed, epoch).

Training deals it round-robin to the ranks (``peagle.train.data``); a streamed dataset's
producer extracts hidden states in exactly this order (``peagle.data.spool``), so the two
agree without talking to each other. Optimizer step s of an epoch reads the permutation's
entries ``[s * G, (s + 1) * G)``, ``G`` the global batch (``BatchPlan.samples_per_global_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BatchPlan:
    """How an epoch splits into optimizer steps for one rank."""

    num_samples: int  # in the split
    world_size: int
    micro_batch_size: int
    grad_accum: int

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    @property
    def samples_per_step(self) -> int:
        """Samples one rank consumes per optimizer step."""
        return self.micro_batch_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return self.samples_per_rank // self.samples_per_step

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.steps_per_epoch * self.grad_accum

    @property
    def samples_per_global_step(self) -> int:
        """Entries of the epoch's permutation one optimizer step reads, over every rank."""
        return self.world_size * self.samples_per_step

    @property
    def read_per_epoch(self) -> int:
        """Entries of an epoch's permutation read (the tail short of a whole step is not)."""
        return self.steps_per_epoch * self.samples_per_global_step

    def check(self) -> None:
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the training split has {self.num_samples} samples, fewer than one optimizer step needs "
                f"(world_size {self.world_size} x micro_batch_size {self.micro_batch_size} x grad_accum "
                f"{self.grad_accum} = {self.world_size * self.samples_per_step}); generate more data "
                "(data.max_samples) or lower train.recipe.batch_size"
            )


def epoch_permutation(num_samples: int, epoch: int, seed: int) -> list[int]:
    """The whole split's order in ``epoch``: the same on every rank and every run."""
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from small integers (numpy's SeedSequence hashing)."""
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 | int(state[1])) & ((1 << 63) - 1)
