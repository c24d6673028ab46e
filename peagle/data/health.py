"""How healthy the target's answers are: a drafter can only learn what the target does.

A target with a wrong chat template, broken weights or too small a generation budget
writes answers that open alike, loop, or stop mid-sentence; every acceptance number
measured on such data says how well a drafter predicts the loop. After regeneration the
data stage measures, over the answers it will train on:

- ``distinct_openings``: the share of answers whose opening (first line) no other answer has;
- ``repeated_token_share``: the share of answer tokens inside an n-gram (``REPEAT_N``
  tokens) that already occurred earlier in the same conversation;
- ``ngram_acceptance``: what vLLM's n-gram lookup (prompt lookup, no head) would accept
  at ``LOOKUP_K`` on these answers, simulated greedily: the floor a trained head must beat;
- ``length_share``: the share of regenerated turns cut by ``data.regenerate.max_tokens``.

It warns, naming the likely causes, when they look degenerate; ``data.strict_health``
refuses to go on. The report is saved as ``health.json`` beside the dataset.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from peagle.config import ConfigError

log = logging.getLogger(__name__)

REPEAT_N = 8  # tokens: a repeated 8-gram is a copied phrase or a loop, not chance
LOOKUP_K = 5  # draft tokens of the simulated n-gram lookup (the K heads are compared at)
LOOKUP_MAX, LOOKUP_MIN = 4, 2  # vLLM's prompt_lookup_max / _min (peagle.contract.NGRAM_LOOKUP)

# Where the numbers stop looking like a working chat model's answers.
MIN_DISTINCT_OPENINGS = 0.5
MAX_REPEATED_SHARE = 0.5
MAX_LENGTH_SHARE = 0.5
MAX_NGRAM_ACCEPTANCE = 3.5


class DataHealthError(ConfigError):
    """``data.strict_health`` and the answers look degenerate."""


@dataclass(frozen=True)
class Answer:
    """One conversation as trained on: its token ids, which are the target's answer, and how the
    answer opens and ended."""

    token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    opening: str
    finish_reasons: Sequence[str] = ()


@dataclass
class HealthReport:
    answers: int
    answer_tokens: int
    distinct_openings: float
    repeated_token_share: float
    ngram_acceptance: float
    length_share: float
    top_openings: list[tuple[str, int]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.warnings

    def summary(self) -> str:
        return (f"{self.answers} answers, {self.answer_tokens} tokens: {self.distinct_openings:.0%} distinct "
                f"openings, {self.repeated_token_share:.0%} of tokens in repeated {REPEAT_N}-grams, n-gram lookup "
                f"would accept {self.ngram_acceptance:.2f} at K = {LOOKUP_K}, {self.length_share:.0%} cut at max_tokens")

    def to_dict(self) -> dict:
        return asdict(self) | {"healthy": self.healthy, "repeat_n": REPEAT_N, "lookup_k": LOOKUP_K}


def opening_of(text: str) -> str:
    """An answer's first line of content (a code fence is markup, not content), as the report
    compares openings."""
    lines = (line.strip() for line in text.splitlines())
    return next((line for line in lines if line and not line.startswith("```")), "")[:80]


def repeated_tokens(ids: Sequence[int], mask: Sequence[bool], n: int = REPEAT_N) -> int:
    """Answer tokens that end, or sit inside, an n-gram seen earlier in the sequence."""
    seen: set[tuple[int, ...]] = set()
    covered = [False] * len(ids)
    for end in range(n, len(ids) + 1):
        gram = tuple(ids[end - n:end])
        if gram in seen:
            covered[end - n:end] = [True] * n
        seen.add(gram)
    return sum(c and m for c, m in zip(covered, mask))


class NgramLookup:
    """vLLM's n-gram lookup over a growing context: after ``context[:p]`` it proposes the K
    tokens that followed the latest earlier occurrence of the context's longest matching
    suffix (``LOOKUP_MAX`` down to ``LOOKUP_MIN`` tokens), cut where the context ends."""

    def __init__(self, ids: Sequence[int]):
        self.ids = list(ids)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(LOOKUP_MIN, LOOKUP_MAX + 1)}
        self.indexed = 0  # every n-gram ending (exclusive) at or before this is in ``latest``

    def _index_until(self, end: int) -> None:
        for e in range(self.indexed + 1, end + 1):
            for n, grams in self.latest.items():
                if e >= n:
                    grams[tuple(self.ids[e - n:e])] = e
        self.indexed = max(self.indexed, end)

    def draft(self, p: int, k: int = LOOKUP_K) -> list[int]:
        self._index_until(p - 1)  # earlier occurrences only, not the suffix itself
        for n in range(LOOKUP_MAX, LOOKUP_MIN - 1, -1):
            if p < n:
                continue
            e = self.latest[n].get(tuple(self.ids[p - n:p]))
            if e is not None:
                return self.ids[e:min(e + k, p)]
        return []


def simulated_lookup_acceptance(ids: Sequence[int], mask: Sequence[bool], k: int = LOOKUP_K) -> tuple[int, int]:
    """(tokens produced, verification steps) of greedy n-gram lookup decoding the answer tokens."""
    lookup = NgramLookup(ids)
    produced = steps = 0
    p = 0
    while p < len(ids):
        if not mask[p]:
            p += 1
            continue
        draft = lookup.draft(p, k)
        accepted = 0
        while accepted < len(draft) and p + accepted < len(ids) and mask[p + accepted] \
                and draft[accepted] == ids[p + accepted]:
            accepted += 1
        step = min(accepted + 1, len(ids) - p)  # the target's own token after the accepted drafts
        produced, steps, p = produced + step, steps + 1, p + step
    return produced, steps


def measure_health(answers: Sequence[Answer]) -> HealthReport:
    answers = [a for a in answers if any(a.loss_mask)]
    tokens = sum(sum(bool(m) for m in a.loss_mask) for a in answers)
    openings = Counter(a.opening for a in answers)
    unique = sum(1 for a in answers if openings[a.opening] == 1)
    repeated = sum(repeated_tokens(a.token_ids, a.loss_mask) for a in answers)
    produced = steps = 0
    for a in answers:
        p, s = simulated_lookup_acceptance(a.token_ids, a.loss_mask)
        produced, steps = produced + p, steps + s
    turns = [r for a in answers for r in a.finish_reasons]
    report = HealthReport(
        answers=len(answers),
        answer_tokens=tokens,
        distinct_openings=unique / len(answers) if answers else 0.0,
        repeated_token_share=repeated / tokens if tokens else 0.0,
        ngram_acceptance=produced / steps if steps else 0.0,
        length_share=sum(r == "length" for r in turns) / len(turns) if turns else 0.0,
        top_openings=[(o, n) for o, n in openings.most_common(3) if n > 1],
    )
    report.warnings = health_warnings(report)
    return report


def health_warnings(report: HealthReport) -> list[str]:
    """What looks degenerate, each with its likely causes."""
    out = []
    if report.distinct_openings < MIN_DISTINCT_OPENINGS:
        top = "; ".join(f"{n} x {o!r}" for o, n in report.top_openings)
        out.append(f"only {report.distinct_openings:.0%} of answers open differently ({top}): the target may "
                   "ignore its prompt (a wrong chat template, or a broken or undertrained target)")
    if report.repeated_token_share > MAX_REPEATED_SHARE:
        out.append(f"{report.repeated_token_share:.0%} of answer tokens repeat an earlier {REPEAT_N}-gram: the "
                   "target loops (a broken or undertrained target; greedy decoding of a small model: try "
                   "data.regenerate.temperature 0.7)")
    if report.length_share > MAX_LENGTH_SHARE:
        out.append(f"{report.length_share:.0%} of answers were cut at data.regenerate.max_tokens: raise it, "
                   "or the target never stops (a wrong chat template or stop token)")
    if report.ngram_acceptance > MAX_NGRAM_ACCEPTANCE:
        out.append(f"n-gram lookup alone would accept {report.ngram_acceptance:.2f} at K = {LOOKUP_K}: the "
                   "answers mostly copy their context, and a head must beat that to be worth training")
    return out


def check_health(report: HealthReport, strict: bool) -> None:
    """Log the report; warn on what looks degenerate, or refuse with ``strict``."""
    log.info("data health: %s", report.summary())
    for warning in report.warnings:
        log.warning("data health: %s", warning)
    if strict and report.warnings:
        raise DataHealthError(
            "the target's answers look degenerate (data.strict_health is on): " + "; ".join(report.warnings)
            + ". Fix the target or the regeneration settings, or set data.strict_health: false to train anyway"
        )
