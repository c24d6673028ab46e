"""Everything the data stage checks before an engine starts, in one place: ``peagle data`` runs
it first, ``peagle config check`` runs it before a GPU node is booked.

``check_data_inputs`` checks that the run directory can be written, that every evaluation
prompt set loads, that the chat template can be sampled for ``kind: magpie`` sources, that
every prompt source opens and parses (a local file, or a hub set the data stage would read),
that ``data.heldout_samples`` and ``train.recipe.max_samples`` fit the prompts, that no evaluation
prompt is a training prompt, and that the mask token occurs in none of the prompts
(``peagle.data.mask_token``: any occurrence is refused, because P-EAGLE retrains the mask
token's embedding).

The data stage checks everything it will read. ``config check`` downloads nothing, starts no
engine and reads what is here: hub sets only from the local cache when the hub is off
(``HF_HUB_OFFLINE``), and the mask token in the first ``CONFIG_CHECK_PROMPTS`` prompts of the
mix (the data stage counts it in every prompt and in every answer). A magpie file the target
has yet to write counts as its ``max_samples`` prompts.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from peagle.config import ConfigError, PipelineConfig, PromptSource
from peagle.data import mask_token
from peagle.data.contamination import check_no_overlap
from peagle.data.prompts import Conversation, check_heldout, load_prompts, source_label
from peagle.data.synthesize import stale_sources, user_turn_opening

CONFIG_CHECK_PROMPTS = 2000  # prompts of the mix `peagle config check` counts the mask token in


@dataclass
class DataInputs:
    """What the checks read: the prompts of the sources that could be read, the evaluation sets,
    and the sources left for later (magpie files to write, hub sets not read here)."""

    prompts: list[Conversation]
    eval_sets: dict[str, list]
    unwritten: list[PromptSource] = field(default_factory=list)  # kind: magpie files the target writes first
    unread: list[PromptSource] = field(default_factory=list)  # kind: hf sets config check does not download
    unread_eval_sets: list[str] = field(default_factory=list)  # benchmarks config check does not download

    def notes(self) -> list[str]:
        """What a user should know was not checked, one line each."""
        out = [f"{source_label(s)}: written by the target in the data stage ({s.max_samples} requests)"
               for s in self.unwritten]
        out += [f"{source_label(s)}: downloaded by the data stage; not read here (the hub is on: only the "
                "cache is read with HF_HUB_OFFLINE=1)" for s in self.unread]
        out += [f"eval set {name!r}: a benchmark the run downloads; not read here" for name in self.unread_eval_sets]
        return out


def check_data_inputs(cfg: PipelineConfig, tokenizer=None, mask_token_id: int | None = None, *,
                      commits: dict[str, str | None] | None = None, download: bool = True,
                      scan: int | None = None, verbose: bool = False) -> DataInputs:
    """Every check of the data stage's inputs that needs no engine; a ``ConfigError`` naming the
    key and the fix at the first that fails. ``tokenizer`` and ``mask_token_id``: the target's
    (None: a target not built yet; the checks that need them are left out). ``commits``: the hub
    sets' commits (``peagle.data.provenance.hub_commits``). ``download=False`` reads no hub set
    or benchmark that is not cached; ``scan``: count the mask token in this many prompts only."""
    from peagle.data.prompt_sets import check_eval_prompts, prompt_set_name

    check_writable(cfg.run_dir, "workdir" if cfg.workdir else "PEAGLE_HOME")
    eval_sets = check_eval_prompts(cfg, hub=download)
    unread_eval_sets = [] if download else [name for name in (*cfg.eval.prompts, cfg.eval.completion_prompts)
                                            if name and prompt_set_name(name) not in eval_sets]
    unwritten = stale_sources(cfg)
    if unwritten and tokenizer is not None:
        user_turn_opening(tokenizer)  # a template that cannot be sampled fails before the engine starts
    unread = [] if download or hub_is_off() else [s for s in cfg.data.sources if s.kind == "hf"]
    skip = {k for k, s in enumerate(cfg.data.sources) if s in unwritten or s in unread}
    readable = len(skip) < len(cfg.data.sources)
    prompts = load_prompts(cfg.data, verbose=verbose, commits=commits, skip=skip) if readable else []
    if not unread:
        check_counts(cfg, expected_prompts(cfg, len(prompts), unwritten))
    check_no_overlap((c.messages for c in prompts), eval_sets)
    if tokenizer is not None:
        mask_token.check_prompts(prompts[:scan] if scan else prompts, tokenizer, cfg.target, mask_token_id)
    return DataInputs(prompts, eval_sets, unwritten, unread, unread_eval_sets)


def hub_is_off() -> bool:
    """Whether ``datasets`` reads hub sets from the local cache only (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE), as ``peagle.data.prompts.open_source`` would."""
    import datasets

    return bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))


def expected_prompts(cfg: PipelineConfig, loaded: int, unwritten: list[PromptSource]) -> int:
    """How many prompts the data stage mixes: those loaded, and the requests magpie sources will
    hold, at most ``data.max_samples``."""
    total = loaded + sum(s.max_samples for s in unwritten)
    return min(total, cfg.data.max_samples) if cfg.data.max_samples else total


def check_counts(cfg: PipelineConfig, prompts: int) -> None:
    """``data.heldout_samples`` leaves prompts to train on, and ``train.recipe.max_samples`` is not more
    than are left (each answer the data stage keeps is one of them)."""
    heldout = cfg.data.heldout_samples
    check_heldout(heldout, prompts)
    left = prompts - heldout
    if cfg.train.recipe.max_samples is not None and cfg.train.recipe.max_samples > left:
        raise ConfigError(
            f"train.recipe.max_samples={cfg.train.recipe.max_samples} is more than the data can hold: {prompts} prompts less "
            f"data.heldout_samples={heldout} leave at most {left} answers to train on; lower train.recipe.max_samples or "
            "add prompts (data.sources, data.max_samples)")


def check_writable(path: Path, key: str) -> None:
    """A file can be made where ``path`` is (or will be made): its nearest existing directory
    takes one. Else a ``ConfigError`` naming ``key``."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(
            f"{key}: {path} cannot be written ({existing}: {err.strerror or err}): set {key} to a directory "
            "this user can write (the run's data, checkpoints and heads go there)") from None
