"""What a config's dataset costs before anything is built: samples, tokens, and disk, stored or
streamed (``data.hidden_states``), against the free disk where the run writes.

Counts are upper bounds from the config and its sources: every prompt the sources give (at
most ``data.max_samples``; a magpie source its ``max_samples`` requests; a hub set not read
here its ``max_samples``, else unknown) and every sequence at its longest (``data.max_seq_len``).
The data stage measures again once it knows the real lengths (``peagle.data.pipeline``).

Stored, the dataset holds every split's hidden states: ``layers x Ht x dtype`` bytes a token.
Streamed, it holds the train split's tokens and the held-out split's hidden states; training
then holds at most ``data.spool_gib`` of hidden states at a time, and extracts the train split
again every epoch (one more prefill of it through the target per epoch), unless all of the
split's hidden states fit in the spool: then they are extracted once and kept for every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.config import ConfigError, PipelineConfig
from peagle.data.preflight import expected_prompts
from peagle.data.store import bytes_per_token, format_bytes, free_bytes, mount_point

STORAGE_CHOICES = ("bfloat16", "float8")  # what the plan prices a stored dataset in, beside the config's own


@dataclass(frozen=True)
class DataBudget:
    samples: int | None  # prompts the build mixes, at most; None: a hub set not counted here
    heldout: int
    max_tokens: int  # a sequence's longest
    num_layers: int  # stored layers
    hidden_size: int
    storage_dtype: str
    hidden_states: str  # stored | streamed
    spool_bytes: int
    free: int
    where: str  # the disk the run writes on
    parts: int = 1  # hosts the data stage is spread over (``orchestration.data_parts``, ``peagle.data.parts``)

    @property
    def train_samples(self) -> int | None:
        return None if self.samples is None else max(0, self.samples - self.heldout)

    def tokens(self, samples: int | None) -> int | None:
        return None if samples is None else samples * self.max_tokens

    def stored_bytes(self, dtype: str) -> int | None:
        tokens = self.tokens(self.samples)
        return None if tokens is None else shard_bytes(tokens, self.num_layers, self.hidden_size, dtype)

    def streamed_bytes(self) -> int | None:
        """The dataset of a streamed build: train tokens (5 bytes each), held-out hidden states."""
        train = self.tokens(self.train_samples)
        if train is None:
            return None
        heldout = shard_bytes(self.tokens(self.heldout), self.num_layers, self.hidden_size, self.storage_dtype)
        return shard_bytes(train, 0, self.hidden_size, self.storage_dtype) + heldout

    def train_hidden_bytes(self) -> int | None:
        """The train split's hidden states, all at once (what a spool keeps when they fit)."""
        tokens = self.tokens(self.train_samples)
        return None if tokens is None else shard_bytes(tokens, self.num_layers, self.hidden_size, self.storage_dtype)

    def streamed_extraction(self) -> str:
        """How often a streamed run extracts the train split (``peagle.data.spool.keeps_whole_split``)."""
        whole, tokens = self.train_hidden_bytes(), self.tokens(self.train_samples)
        if whole is not None and whole <= self.spool_bytes:
            return (f"the train split's hidden states (at most {format_bytes(whole)}) fit the spool: extracted once "
                    "and kept for every epoch")
        return (f"every epoch extracts the train split again ({'unknown' if tokens is None else f'{tokens:,}'} tokens "
                "of prefill through the target)")

    def needed(self) -> int | None:
        """What this config's dataset (and, streamed, its spool) takes at most on the run's disk."""
        if self.hidden_states == "stored":
            return self.stored_bytes(self.storage_dtype)
        streamed = self.streamed_bytes()
        return None if streamed is None else streamed + self.spool_bytes

    def lines(self) -> list[str]:
        def size(n: int | None) -> str:
            return "unknown (a hub set not counted here: give it max_samples)" if n is None else format_bytes(n)

        def count(n: int | None) -> str:
            return "unknown" if n is None else f"{n:,}"

        tokens = self.tokens(self.samples)
        stored = ", ".join(f"{size(self.stored_bytes(d))} in {d}"
                           for d in dict.fromkeys((self.storage_dtype, *STORAGE_CHOICES)))
        return [
            f"samples: at most {count(self.samples)} ({count(self.train_samples)} to train on), each at most "
            f"{self.max_tokens:,} tokens: at most {count(tokens)} tokens",
            f"hidden states: {self.num_layers} layers x {self.hidden_size} a token "
            f"({format_bytes(self.num_layers * self.hidden_size * 2)} in bfloat16)",
            f"stored (data.hidden_states: stored): {stored}",
            f"streamed (data.hidden_states: streamed): {size(self.streamed_bytes())} of dataset + a spool of at most "
            f"{format_bytes(self.spool_bytes)} while training; {self.streamed_extraction()}",
            f"disk: {format_bytes(self.free)} free at {self.where}; this config ({self.hidden_states}) needs at most "
            f"{size(self.needed())}",
            *([self.parts_line()] if self.parts > 1 else []),
        ]

    def parts_line(self) -> str:
        share = "an equal share of the" if self.samples is None else f"at most {-(-self.samples // self.parts):,}"
        return (f"hosts: the data stage in {self.parts} parts (orchestration.data_parts), {share} samples each, a "
                "worker each; a part's store is moved into the dataset when every part is done (no extra disk)")

    def check_fits(self) -> None:
        """``peagle config check``: a dataset that cannot fit is refused (``ConfigError``)."""
        problem = self.shortfall()
        if problem:
            raise ConfigError(problem)

    def shortfall(self, already_stored: int = 0) -> str | None:
        """Why the dataset cannot fit the disk (naming streaming when it is stored), or None.
        ``already_stored``: bytes of it a resumed build has written (no longer free, no longer needed)."""
        need = self.needed()
        if need is None or need - already_stored <= self.free:
            return None
        if self.hidden_states == "stored":
            return (
                f"data: a stored dataset of this config takes up to {format_bytes(need)} ({samples_and_lengths(self)}) and "
                f"{self.where} has {format_bytes(self.free)} free: set data.hidden_states: streamed (the train "
                f"split's hidden states extracted while training into a spool of data.spool_gib, "
                f"{format_bytes(self.streamed_bytes() + self.spool_bytes)} in all here), or lower data.max_samples / "
                "data.max_seq_len, or use data.storage_dtype: float8, or point workdir at a larger disk")
        return (
            f"data: even streamed, this config needs up to {format_bytes(need)} (its tokens, held-out hidden states "
            f"and a spool of {format_bytes(self.spool_bytes)}) and {self.where} has {format_bytes(self.free)} free: "
            "lower data.spool_gib, data.max_samples or data.max_seq_len, or point workdir at a larger disk")


def shard_bytes(num_tokens: int, num_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Shards of ``num_tokens`` tokens, headers and manifests included (1%): the data stage adds
    its own margin when it checks again with the real lengths."""
    return int(num_tokens * bytes_per_token(num_layers, hidden_size, storage_dtype) * 1.01)


def samples_and_lengths(budget: DataBudget) -> str:
    return f"{budget.samples:,} samples of up to {budget.max_tokens:,} tokens"


def data_budget(cfg: PipelineConfig, num_layers: int, hidden_size: int, samples: int | None) -> DataBudget:
    """The budget of ``cfg``'s dataset for a target storing ``num_layers`` layers of ``hidden_size``,
    from ``samples`` prompts (``expected_samples``)."""
    max_tokens = min(cfg.data.max_seq_len, cfg.vllm.max_model_len - 1)
    return DataBudget(
        samples=samples, heldout=cfg.data.heldout_samples, max_tokens=max_tokens, num_layers=num_layers,
        hidden_size=hidden_size, storage_dtype=cfg.data.storage_dtype, hidden_states=cfg.data.hidden_states,
        spool_bytes=int(cfg.data.spool_gib * 2**30) if cfg.data.hidden_states == "streamed" else 0,
        free=free_bytes(cfg.run_dir), where=str(mount_point(cfg.run_dir)), parts=cfg.orchestration.data_parts,
    )


def expected_samples(cfg: PipelineConfig, loaded: int, unwritten: list, unread: list) -> int | None:
    """Prompts the build mixes (``peagle.data.preflight.expected_prompts``), a hub set not read
    here counted by its ``max_samples``; with one that has none, only ``data.max_samples`` bounds
    the mix (None when unset)."""
    if any(s.max_samples is None for s in unread):
        return cfg.data.max_samples
    return expected_prompts(cfg, loaded + sum(s.max_samples for s in unread), unwritten)
