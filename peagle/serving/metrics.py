"""Speculative-decoding counters read from a running engine (``LLM.get_metrics()``).

vLLM keeps cumulative Prometheus counters per engine: drafts (one per drafting step of
one request), draft tokens, accepted draft tokens and accepted tokens per draft
position. Read a snapshot before and after a workload and take the ``delta``; the
acceptance length is then ``1 + accepted / drafts`` (the bonus token included), the
number the P-EAGLE paper and vLLM's docs report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens produced per target forward pass: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """For each draft position k, the fraction of drafts whose token k was accepted."""
        if not self.num_drafts:
            return [float("nan")] * len(self.accepted_per_position)
        return [a / self.num_drafts for a in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
        }


def stats_from_metrics(metrics) -> SpecDecodeStats:
    """Sum the spec-decode counters of a ``get_metrics()`` snapshot over engines."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {DRAFTS: 0, DRAFT_TOKENS: 0, ACCEPTED: 0}
    per_pos: list[int] = []
    for m in metrics:
        if isinstance(m, Counter) and m.name in totals:
            totals[m.name] += int(m.value)
        elif isinstance(m, Vector) and m.name == ACCEPTED_PER_POS:
            if len(m.values) > len(per_pos):
                per_pos += [0] * (len(m.values) - len(per_pos))
            for i, v in enumerate(m.values):
                per_pos[i] += int(v)
    return SpecDecodeStats(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED], per_pos)


def read_spec_decode_stats(llm) -> SpecDecodeStats:
    """The engine's cumulative counters now (all zero without speculative decoding).

    Needs an engine started with stats logging on, as ``peagle.serving.engine.open_llm`` does.
    """
    return stats_from_metrics(llm.get_metrics())


def delta(before: SpecDecodeStats, after: SpecDecodeStats) -> SpecDecodeStats:
    """The counts of the work done between two snapshots."""
    n = max(len(before.accepted_per_position), len(after.accepted_per_position))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    return SpecDecodeStats(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=[a - b for a, b in zip(pad(after.accepted_per_position), pad(before.accepted_per_position))],
    )
