"""What each rank trains on, in which order: deterministic, shardable, resumable.

An epoch's order is a permutation seeded by (seed, epoch), dealt round-robin to the
ranks, so every rank knows its samples without talking to the others and a resumed run
sees exactly the same order. The randomness inside an example (COD sampling) comes
from a generator seeded by (seed, epoch, sample index), not from a running stream, so
resuming mid-epoch rebuilds bit-identical examples without saving generator states.

Dealt round-robin, rank r's i-th sample is the permutation's entry ``i * world_size + r``,
so optimizer step s of an epoch trains entries ``[s * G, (s + 1) * G)`` with ``G`` the
global batch (``train.recipe.batch_size`` = ``world_size x grad_accum x micro_batch_size``): the same samples however ``G``
splits into ranks and accumulation, which is what lets a run resume at another world size.

Every rank gets the same number of micro-batches per epoch (the tail that does not
fill a whole optimizer step on every rank is dropped): DeepSpeed's collectives need all
ranks to step together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from peagle.data.order import BatchPlan, epoch_permutation, mix_seed


def training_samples(samples: Sequence, max_samples: int | None) -> Sequence:
    """The first ``max_samples`` of the train split (``train.recipe.max_samples``; None: all of it)."""
    if max_samples is None:
        return samples
    if max_samples > len(samples):
        raise ValueError(f"train.recipe.max_samples is {max_samples} but the train split holds {len(samples)} answers: "
                         "lower train.recipe.max_samples, or build more data (data.max_samples)")
    return Subset(samples, range(max_samples))


def rank_order(plan: BatchPlan, epoch: int, seed: int, rank: int) -> list[int]:
    """Sample indices rank ``rank`` trains on in ``epoch`` (equal length on every rank)."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside world size {plan.world_size}")
    mine = epoch_permutation(plan.num_samples, epoch, seed)[rank :: plan.world_size]
    return mine[: plan.micro_batches_per_epoch * plan.micro_batch_size]


def example_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator owned by one (epoch, sample): COD draws do not depend on what ran before."""
    return torch.Generator().manual_seed(mix_seed(seed, epoch, index))


class EpochSamples(Dataset):
    """Sample ``i`` of the split turned into one training example for the current epoch.

    ``make_example(sample, generator)`` is the objective's example builder (P-EAGLE or
    EAGLE-3). Items are ``(example, num_tokens, index)``: the token count feeds tokens/s,
    the index the step's record of which samples it trained on.
    """

    def __init__(self, samples: Sequence, make_example: Callable[[Any, torch.Generator], Any], seed: int):
        self.samples = samples
        self.make_example = make_example
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.samples, "set_epoch"):  # a streamed split reads each epoch from its own chunks
            self.samples.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        sample = self.samples[index]
        example = self.make_example(sample, example_generator(self.seed, self.epoch, index))
        return example, int(sample.token_ids.numel()), index


class MicroBatches(Sampler[list[int]]):
    """This rank's micro-batches of one epoch, starting after ``skip`` of them (resume)."""

    def __init__(self, order: list[int], micro_batch_size: int, skip: int = 0):
        self.batches = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
        if not 0 <= skip <= len(self.batches):
            raise ValueError(f"cannot skip {skip} of {len(self.batches)} micro-batches in this epoch")
        self.skip = skip

    def __iter__(self):
        return iter(self.batches[self.skip :])

    def __len__(self) -> int:
        return len(self.batches) - self.skip


def epoch_loader(
    dataset: EpochSamples,
    plan: BatchPlan,
    epoch: int,
    rank: int,
    collate: Callable[[list], Any],
    skip_micro_batches: int = 0,
) -> DataLoader:
    """Micro-batches ``(batch, num_tokens, sample_indices)`` of ``epoch`` for ``rank``, in the fixed order.

    Built in the main process (no workers): example construction is cheap next to the
    drafter's forward, and it keeps the order and the generators trivially reproducible.
    """
    dataset.set_epoch(epoch)
    order = rank_order(plan, epoch, dataset.seed, rank)
    sampler = MicroBatches(order, plan.micro_batch_size, skip_micro_batches)

    def collate_with_tokens(items):
        examples, tokens, indices = zip(*items)
        return collate(list(examples)), sum(tokens), list(indices)

    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_with_tokens, num_workers=0)
