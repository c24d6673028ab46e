"""Training for a time budget (``train.recipe.max_train_seconds``) instead of a number of steps.

Users retraining on a schedule have a compute window, not a step count; and comparing two
drafting methods fairly means giving each the same training time (P-EAGLE takes cheaper
steps than EAGLE-3, so equal steps hand EAGLE-3 more time). The clock sums the
seconds of optimizer steps (checkpointing and evaluation excluded); ranks agree on it (the
slowest rank counts), so they take the same learning rates and stop at the same step.

A process's first optimizer step is not counted (its record says ``first_in_process``): it
compiles (DeepSpeed's Muon update is torch.compiled) and allocates, taking many steady steps'
time, more or less by how warm inductor's cache is. Counted, it would charge whichever head
trains first on a fresh machine for the compilation the other then finds cached, a large
share of a short budget. ``counted_seconds`` applies the same rule to a
finished run's records (the EAGLE-3 baseline's budget), as the benchmarks' calibration does.

The learning-rate schedule keeps the step schedule's shape (linear warmup over
``train.recipe.warmup_ratio`` of the budget, then linear decay to 0) on the *fraction of the budget
that will have passed at the end of the step* a rate is for, estimated from the mean counted
step so far. Until one step has been counted nothing can be estimated: the first three steps
(their rates are set before the second step ends) run at rate 0 and only prime the optimizer's
moments when there is a warmup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

FIRST_IN_PROCESS = "first_in_process"  # the metrics record of a step the clock leaves out


def counted_seconds(records: list[dict]) -> float:
    """The seconds a run's steps count on the clock: every step's but each process's first."""
    return sum(r.get("step_time_s", 0.0) for r in records if not r.get(FIRST_IN_PROCESS))


@dataclass
class TrainingClock:
    """Summed optimizer-step seconds, and how far into ``budget_s`` they are."""

    budget_s: float
    elapsed_s: float = 0.0
    steps: int = 0  # optimizer steps done, counted or not
    counted: int | None = None  # of which counted (None: all of them)

    def __post_init__(self):
        self.restore(self.elapsed_s, self.steps, self.counted)

    def restore(self, elapsed_s: float, steps: int, counted: int | None) -> None:
        """Set the clock in place (a resumed run: the LR schedule holds this object); ``counted``
        None, as in a state written before first steps were left out, counts every step."""
        self.elapsed_s, self.steps = elapsed_s, steps
        self.counted = steps if counted is None else counted

    def add(self, seconds: float, device, world_size: int) -> None:
        """Count one step: the slowest rank's seconds, so every rank holds the same clock."""
        if world_size > 1 and dist.is_initialized():
            value = torch.tensor([seconds], dtype=torch.float64, device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            seconds = float(value.cpu()[0])
        self.elapsed_s += seconds
        self.steps += 1
        self.counted += 1

    def skip(self) -> None:
        """A step done but not counted: a process's first (every rank skips the same one)."""
        self.steps += 1

    @property
    def mean_step_s(self) -> float | None:
        return self.elapsed_s / self.counted if self.counted else None

    def fraction_at_end_of(self, step: int) -> float:
        """The budget's fraction passed when 0-based optimizer step ``step`` ends (0 before a step is timed)."""
        mean = self.mean_step_s
        if mean is None:
            return 0.0
        return (self.elapsed_s + (step + 1 - self.steps) * mean) / self.budget_s

    def done(self) -> bool:
        """Another step would end nearer past the budget than the last one ended before it."""
        mean = self.mean_step_s
        return mean is not None and self.elapsed_s + mean / 2 >= self.budget_s


def time_warmup_decay(clock: TrainingClock, warmup_ratio: float, max_steps: int = 0):
    """LR factor for 0-based optimizer step s: linear warmup to 1 over ``warmup_ratio`` of the
    budget, then linear decay to 0 at its end (``warmup_decay``'s shape, on time). With
    ``max_steps`` too, on whichever of the two the run is further through."""

    def factor(step: int) -> float:
        fraction = max(clock.fraction_at_end_of(step), (step + 1) / max_steps if max_steps else 0.0)
        if fraction < warmup_ratio:
            return fraction / warmup_ratio
        return min(1.0, max(0.0, (1.0 - fraction) / (1.0 - warmup_ratio)))

    return factor
