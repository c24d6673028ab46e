"""Online evaluation: acceptance length and output tokens/s of heads served in vLLM.

Two kinds of traffic: chat prompts (through the target's chat template) and, when given,
completion prompts (raw documents, e.g. code to continue, no template); both are measured
on the same engines, the second into ``OnlineResult.completion``.

For every (head, K) one engine is started and reused across concurrency levels and prompt
sets; the target alone (no speculation) is the baseline, and vLLM's training-free n-gram
lookup (prompt lookup, no head) at the same K is the floor a trained head must beat. Concurrency c means the prompts are
submitted in waves of c requests, each wave finishing before the next starts. Sampling
is greedy. One short warm-up request per engine runs before anything is timed, and the
speculative-decoding counters are read before and after each measurement, so every row
counts only its own requests.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peagle.catalogue import DEFAULT_METHOD, describe
from peagle.config import VllmConfig
from peagle.contract import CONFIG_FILE, NGRAM, WEIGHTS_FILE, ngram_speculative_config, speculative_config
from peagle.data.prompt_sets import fit_prompts, tokenize_prompts
from peagle.fileio import write_json_atomic

log = logging.getLogger(__name__)

BASELINE = "baseline"
WARMUP_TOKENS = 8
TABLE_CAPTION = (
    "tokens/step: output tokens per target forward pass over every decode step, what speed follows; "
    "a range where vLLM's counts leave it open (n-gram lookup: draft tokens accepted past a request's "
    "end, at most K a request, are counted but not output). vLLM acc. length: 1 + accepted / drafts "
    "over the steps that drafted. A head drafts at every step: for it the two agree but for those "
    "tokens. n-gram lookup drafts only where its lookup matches: its vLLM figure is not per step."
)

# ---------------------------------------------------------------- results


@dataclass
class OnlineRow:
    method: str  # "baseline" or the head's label
    k: int  # speculative tokens; 0 for the baseline
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    acceptance_length: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    parallel_drafting: bool | None = None
    engine_start_s: float = 0.0

    @property
    def decode_tokens(self) -> int:
        """Output tokens the decode steps made: each request's first token comes from its prefill."""
        return self.output_tokens - self.requests

    @property
    def tokens_per_step(self) -> float | None:
        """Output tokens per target forward pass over every decode step, drafting or not: the
        figure speed follows, and the one heads and n-gram lookup are compared on.

        The steps are counted as decode tokens less accepted draft tokens, and never fewer than
        the drafts (one per step that drafted). A head drafts at every step, so its steps are its
        drafts and its figure is exact. n-gram lookup drafts only where its lookup matches; vLLM
        counts the draft tokens a request's last step accepted past its end (max_tokens or a stop
        token), which the output drops, so for n-gram lookup this is the most the figure can be
        and ``min_tokens_per_step`` the least. No speculation makes one token a step: 1.0. None
        for a speculative row that proposed no drafts (its head did not draft)."""
        if not self.k:
            return 1.0
        steps = max(self.decode_tokens - self.num_accepted_tokens, self.num_drafts)
        return self.decode_tokens / steps if self.num_drafts and steps > 0 else None

    @property
    def min_tokens_per_step(self) -> float | None:
        """The least ``tokens_per_step`` can be: each request's last step may have accepted up
        to K draft tokens past its end, counted by vLLM but not output. A head's figure is exact."""
        most = self.tokens_per_step
        if most is None or self.method != NGRAM:
            return most
        past_the_end = min(self.num_accepted_tokens, self.k * self.requests)
        return self.decode_tokens / (self.decode_tokens - self.num_accepted_tokens + past_the_end)

    def tokens_per_step_text(self) -> str:
        """Tokens per target step as tables print it: ``1.38``, or ``1.39-1.45`` where it is a range."""
        most, least = self.tokens_per_step, self.min_tokens_per_step
        if most is None:
            return "-"
        return f"{most:.2f}" if f"{least:.2f}" == f"{most:.2f}" else f"{least:.2f}-{most:.2f}"


@dataclass
class OnlineResult:
    """One prompt set's rows; the first of ``eval.prompts`` holds the others measured on the
    same engines (``more_sets``) and the completion traffic (``completion``)."""

    target: str
    max_tokens: int
    prompt_set: str = ""
    rows: list[OnlineRow] = field(default_factory=list)
    completion: OnlineResult | None = None  # the same engines on completion traffic, when measured
    more_sets: list[OnlineResult] = field(default_factory=list)  # the other chat prompt sets

    def prompt_sets(self) -> list[OnlineResult]:
        """Every set measured, this one first, completion traffic last."""
        return [self, *self.more_sets, *([self.completion] if self.completion else [])]

    def baseline(self, concurrency: int) -> OnlineRow | None:
        return next((r for r in self.rows if r.method == BASELINE and r.concurrency == concurrency), None)

    def ngram(self, k: int, concurrency: int) -> OnlineRow | None:
        return next((r for r in self.rows if r.method == NGRAM and r.k == k and r.concurrency == concurrency), None)

    def speedup(self, row: OnlineRow) -> float | None:
        """Output tokens/s relative to the baseline at the same concurrency."""
        base = self.baseline(row.concurrency)
        return row.output_tokens_per_s / base.output_tokens_per_s if base and base.output_tokens_per_s else None

    def fastest_k(self, method: str) -> dict[int, tuple[int, float]]:
        """Concurrency -> (the K at which ``method`` served the most output tokens/s, its speed-up
        over no speculation at that concurrency)."""
        out: dict[int, tuple[int, float]] = {}
        for r in self.rows:
            if r.method == method and r.k and (s := self.speedup(r)) is not None:
                if r.concurrency not in out or s > out[r.concurrency][1]:
                    out[r.concurrency] = (r.k, s)
        return dict(sorted(out.items()))

    def over_ngram(self, row: OnlineRow) -> float | None:
        """Output tokens/s relative to n-gram lookup at the same K and concurrency: above 1, the
        head earns its training."""
        floor = self.ngram(row.k, row.concurrency) if row.k else None
        if floor is None or row.method == NGRAM or not floor.output_tokens_per_s:
            return None
        return row.output_tokens_per_s / floor.output_tokens_per_s

    def methods(self) -> list[str]:
        """The labels of the rows that speculate: the heads and the n-gram floor."""
        return list(dict.fromkeys(r.method for r in self.rows if r.method != BASELINE))

    def heads(self) -> list[str]:
        """The labels of the trained heads (not the n-gram floor)."""
        return [m for m in self.methods() if m != NGRAM]

    def acceptance_by_k(self, method: str, concurrency: int | None = None) -> dict[int, float]:
        """K -> vLLM's acceptance length for one method (at the lowest concurrency unless given):
        1 + accepted / drafts over the steps that drafted. For a head it is its tokens per step (but
        for draft tokens accepted past a request's end); n-gram lookup's is not comparable."""
        return self._by_k(method, "acceptance_length", concurrency)

    def tokens_per_step_by_k(self, method: str, concurrency: int | None = None) -> dict[int, float]:
        """K -> tokens per target step (``OnlineRow.tokens_per_step``): what heads and n-gram lookup
        are compared on."""
        return self._by_k(method, "tokens_per_step", concurrency)

    def min_tokens_per_step_by_k(self, method: str, concurrency: int | None = None) -> dict[int, float]:
        """K -> the least tokens per target step can be (``OnlineRow.min_tokens_per_step``)."""
        return self._by_k(method, "min_tokens_per_step", concurrency)

    def _by_k(self, method: str, name: str, concurrency: int | None) -> dict[int, float]:
        rows = [r for r in self.rows if r.method == method and getattr(r, name) is not None]
        if not rows:
            return {}
        c = concurrency if concurrency is not None else min(r.concurrency for r in rows)
        return {r.k: getattr(r, name) for r in rows if r.concurrency == c}

    def to_records(self) -> list[dict]:
        records = []
        for r in self.rows:
            rec = asdict(r) | {"target": self.target, "prompt_set": self.prompt_set, "max_tokens": self.max_tokens}
            rec["tokens_per_step"] = r.tokens_per_step
            rec["min_tokens_per_step"] = r.min_tokens_per_step
            rec["speedup"] = self.speedup(r)
            rec["over_ngram"] = self.over_ngram(r)
            records.append(rec)
        return records

    def to_table(self, title: str | None = None):
        """A rich table, one row per (method, K, concurrency), with speed-up over the baseline."""
        from rich.table import Table

        table = Table(title=title or f"Online evaluation in vLLM: {self.target} ({self.prompt_set})",
                      caption=TABLE_CAPTION)
        for col in ("method", "K", "conc.", "tokens/step", "vLLM acc. length", "per-position acceptance",
                    "out tok/s", "speed-up", "vs n-gram", "requests"):
            table.add_column(col, justify="left" if col in ("method", "per-position acceptance") else "right")
        for r in self.rows:
            speedup, over_ngram = self.speedup(r), self.over_ngram(r)
            table.add_row(
                r.method,
                str(r.k) if r.k else "-",
                str(r.concurrency),
                r.tokens_per_step_text(),
                f"{r.acceptance_length:.2f}" if r.acceptance_length is not None else "-",
                " ".join(f"{a:.2f}" for a in r.per_position_acceptance) or "-",
                f"{r.output_tokens_per_s:.1f}",
                f"{speedup:.2f}x" if speedup is not None else "-",
                f"{over_ngram:.2f}x" if over_ngram is not None else "-",
                str(r.requests),
            )
        return table

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> OnlineResult:
        completion = data.get("completion")
        return cls(**{**data, "rows": [OnlineRow(**r) for r in data["rows"]],
                      "completion": cls.from_dict(completion) if completion else None,
                      "more_sets": [cls.from_dict(d) for d in data.get("more_sets", [])]})

    @classmethod
    def load(cls, path: str | Path) -> OnlineResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------- measuring


def _check_inputs(heads: Mapping[str, Path], ks, concurrency, max_tokens: int, vllm_cfg: VllmConfig) -> None:
    """Fail before any engine starts: missing heads, bad levels, too small an engine."""
    for label, head in heads.items():
        if label == BASELINE:
            raise ValueError(f"{BASELINE!r} is reserved for the no-speculation run; rename that head")
        if not (Path(head) / CONFIG_FILE).exists() or not (Path(head) / WEIGHTS_FILE).exists():
            raise FileNotFoundError(f"head {label!r}: {head} has no config.json/model.safetensors; export it first")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks={list(ks)}: list speculative token counts K >= 1")
    if not concurrency or any(c < 1 for c in concurrency):
        raise ValueError(f"concurrency={list(concurrency)}: list levels >= 1")
    if max(concurrency) > vllm_cfg.max_num_seqs:
        raise ValueError(
            f"concurrency {max(concurrency)} exceeds vllm.max_num_seqs={vllm_cfg.max_num_seqs}: "
            "raise vllm.max_num_seqs or lower eval.concurrency"
        )
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")


def measure(llm, prompts: list[list[int]], *, concurrency: int, max_tokens: int):
    """Generate every prompt in waves of ``concurrency``; returns (outputs, wall seconds, spec stats delta)."""
    from peagle.serving.generation import generate_from_token_ids
    from peagle.serving.metrics import delta, read_spec_decode_stats

    before = read_spec_decode_stats(llm)
    outputs = []
    started = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        wave = prompts[i : i + concurrency]
        outputs += generate_from_token_ids(llm, wave, max_tokens=[max_tokens] * len(wave))
    wall = time.perf_counter() - started
    return outputs, wall, delta(before, read_spec_decode_stats(llm))


def _warm_up(llm, prompt: list[int]) -> None:
    from peagle.serving.generation import generate_from_token_ids

    generate_from_token_ids(llm, [prompt], max_tokens=[WARMUP_TOKENS])


def _row(method, k, concurrency, outputs, wall, stats, parallel, startup) -> OnlineRow:
    tokens = sum(len(o.token_ids) for o in outputs)
    speculative = k > 0 and stats.num_drafts > 0
    return OnlineRow(
        method=method,
        k=k,
        concurrency=concurrency,
        requests=len(outputs),
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall > 0 else math.nan,
        acceptance_length=stats.acceptance_length if speculative else None,
        per_position_acceptance=stats.per_position_acceptance if speculative else [],
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        parallel_drafting=parallel,
        engine_start_s=startup,
    )


def evaluate_online(
    target_path: str | Path,
    heads: Mapping[str, str | Path],
    vllm_cfg: VllmConfig,
    prompts: Sequence,
    *,
    ks: Sequence[int],
    concurrency: Sequence[int] = (1,),
    max_tokens: int = 128,
    methods: Mapping[str, str] | None = None,
    tokenizer=None,
    include_baseline: bool = True,
    prompt_set: str = "",
    target_revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    on_row: Callable[[OnlineRow], None] | None = None,
    completion_prompts: Sequence[str] = (),
    completion_prompt_set: str = "",
    largest_k_only: Collection[str] = (),
    more_prompt_sets: Mapping[str, Sequence] | None = None,
    include_ngram: bool = True,
) -> OnlineResult:
    """Serve each head at each K (plus the target alone) and measure every concurrency level.

    ``heads`` maps a label (a method's ``label``, or any name) to a head directory;
    ``prompts`` are token-id lists or chat messages (tokenised with ``tokenizer``, by
    default the target's). ``methods`` gives each label's drafting method's name (default
    P-EAGLE): it decides whether vLLM drafts in parallel. ``on_row`` sees each row as soon
    as it is measured. ``completion_prompts`` (raw texts) are measured on the same engines
    after the chat prompts, into ``result.completion``; ``more_prompt_sets`` (name -> chat prompts)
    likewise into ``result.more_sets``. ``include_ngram`` serves vLLM's n-gram lookup at every K,
    the training-free floor (label ``ngram``). Heads labelled in ``largest_k_only`` are
    served at the largest K alone: one engine where a comparison needs no more (the registry
    champion: the gate compares at the largest K).
    """
    from peagle.serving import open_llm

    heads = {label: Path(h) for label, h in heads.items()}
    ks, concurrency = sorted(set(ks)), sorted(set(concurrency))
    _check_inputs(heads, ks, concurrency, max_tokens, vllm_cfg)
    methods = dict(methods or {})
    for what, labels in (("methods", methods), ("largest_k_only", largest_k_only)):
        if set(labels) - set(heads):
            raise ValueError(f"{what} names heads {sorted(set(labels) - set(heads))} that are not in heads {sorted(heads)}")
    parallel = {label: describe(methods.get(label, DEFAULT_METHOD)).parallel_drafting for label in heads}
    chat_prompts = bool(prompts) and not isinstance(prompts[0][0] if prompts[0] else 0, int)
    if tokenizer is None and (chat_prompts or completion_prompts or more_prompt_sets):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(target_path), revision=target_revision, trust_remote_code=trust_remote_code
        )

    def fitted(texts: Sequence) -> list[list[int]]:
        return fit_prompts(tokenize_prompts(list(texts), tokenizer), vllm_cfg.max_model_len, max_tokens, max(ks))

    token_prompts = fitted(prompts)
    result = OnlineResult(target=str(target_path), max_tokens=max_tokens, prompt_set=prompt_set)
    traffic = [(result, token_prompts)]
    for name, texts in (more_prompt_sets or {}).items():
        result.more_sets.append(OnlineResult(target=str(target_path), max_tokens=max_tokens, prompt_set=name))
        traffic.append((result.more_sets[-1], fitted(texts)))
    if completion_prompts:
        result.completion = OnlineResult(target=str(target_path), max_tokens=max_tokens,
                                         prompt_set=completion_prompt_set)
        traffic.append((result.completion, fitted(completion_prompts)))

    runs: list[tuple[str, int, dict | None, bool | None]] = []
    if include_baseline:
        runs.append((BASELINE, 0, None, None))
    if include_ngram:
        if NGRAM in heads:
            raise ValueError(f"{NGRAM!r} is reserved for vLLM's n-gram lookup; rename that head")
        runs += [(NGRAM, k, ngram_speculative_config(k), None) for k in ks]
    for label, head in heads.items():
        runs += [(label, k, speculative_config(str(Path(head).resolve()), k, parallel_drafting=parallel[label]),
                  parallel[label]) for k in (ks[-1:] if label in largest_k_only else ks)]

    for method, k, spec_cfg, par in runs:
        log.info("online eval: starting engine for %s K=%d", method, k)
        with open_llm(
            str(target_path),
            vllm_cfg,
            revision=target_revision,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            speculative_config=spec_cfg,
        ) as llm:
            _warm_up(llm, token_prompts[0])
            for into, texts in traffic:
                for c in concurrency:
                    outputs, wall, stats = measure(llm, texts, concurrency=c, max_tokens=max_tokens)
                    row = _row(method, k, c, outputs, wall, stats, par, llm.peagle_startup_s)
                    if k and row.num_drafts == 0:
                        log.warning("%s K=%d proposed no drafts: is the head loaded with speculative decoding?",
                                    method, k)
                    into.rows.append(row)
                    if on_row:
                        on_row(row)
    return result
