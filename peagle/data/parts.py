"""The data stage spread over hosts: each host builds a part, one build then takes them in.

Part I of N (0-based: ``peagle data --part I/N``, or a flow run of the data-part deployment
that the Prefect data flow starts for each part when ``orchestration.data_parts`` is N)
takes the I-th of N contiguous slices of the dataset's records, held-out ones included, in
the order one host's build writes them. It regenerates and extracts that slice into a store
of its own, ``<data>/parts/I-of-N/``, and writes ``part.json`` last, once complete; part 0
also builds the served split (``peagle.data.served``) with its engine. A part
is resumable like the whole build, and parts share nothing but the volume ``PEAGLE_HOME`` is
on, so they run at once on as many hosts.

The build that follows (``peagle data``, or the data flow's own task once every part run has
finished) checks that all N parts are complete and of its configuration (else a clear error
before any work), reuses their regenerated answers, and moves their shards into one store in
part order: the store one host would have written, each sample once, and part 0's served
split. It then builds the draft vocabulary from the whole train split and, on commit, removes
``parts/``. Only the Magpie requests (``kind: magpie`` sources, written once before the
parts) need an engine where the parts are taken in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from peagle.config import ConfigError
from peagle.fileio import write_json_atomic
from peagle.layout import DataLayout

_LABEL = re.compile(r"(\d+)-of-(\d+)")


@dataclass(frozen=True)
class Part:
    """Part ``index`` (0-based) of ``count``."""

    index: int
    count: int

    def __post_init__(self):
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ConfigError(f"data part {self.index}/{self.count}: a part is I/N with 0 <= I < N "
                              f"(the parts of 2 hosts are 0/2 and 1/2)")

    @classmethod
    def parse(cls, text: str) -> Part:
        """``"I/N"`` as given to ``peagle data --part``."""
        index, slash, count = text.partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit():
            raise ConfigError(f"--part {text!r}: give the part as I/N, 0 <= I < N (the parts of 2 hosts are 0/2 "
                              "and 1/2)")
        return cls(int(index), int(count))

    @property
    def label(self) -> str:
        return f"{self.index}-of-{self.count}"

    def take(self, items: list) -> list:
        """This part's contiguous slice of ``items``; the N parts cover each item once."""
        n = len(items)
        return items[n * self.index // self.count : n * (self.index + 1) // self.count]


def part_layout(data: DataLayout, part: Part) -> DataLayout:
    return data.part(part.label)


def mark_done(layout: DataLayout, part: Part, config_hash: str, samples: int) -> None:
    write_json_atomic(layout.part_done, {"part": part.index, "of": part.count, "config_hash": config_hash,
                                         "samples": samples}, indent=None)


def finished_parts(data: DataLayout, config_hash: str, config_hint: str = "CONFIG") -> list[DataLayout]:
    """The part layouts in ``data`` in part order, when all of one splitting are complete and of
    ``config_hash``; none when no part was built; else ``ConfigError`` naming what to do."""
    if not data.parts_dir.is_dir():
        return []
    found: dict[int, dict[int, DataLayout]] = {}
    for path in sorted(data.parts_dir.iterdir()):
        match = _LABEL.fullmatch(path.name)
        if match is None or not path.is_dir():
            raise ConfigError(f"{path} is not a part of the data stage (parts are named I-of-N): move it out of "
                              f"{data.parts_dir}")
        found.setdefault(int(match[2]), {})[int(match[1])] = DataLayout(path)
    if len(found) > 1:
        raise ConfigError(f"{data.parts_dir} holds parts of {len(found)} splittings ({', '.join(map(str, found))} "
                          "parts): delete the directories of the one not in use")
    ((count, parts),) = found.items()
    unfinished = [Part(i, count) for i in range(count) if i not in parts or not parts[i].part_done.exists()]
    if unfinished:
        todo = ", ".join(f"`peagle data {config_hint} --part {p.index}/{p.count}`" for p in unfinished)
        raise ConfigError(f"{len(unfinished)} of the {count} parts of this dataset in {data.parts_dir} are not "
                          f"finished: run {todo} (the Prefect data flow reruns its part runs), then this again")
    for layout in parts.values():
        built_with = json.loads(layout.part_done.read_text()).get("config_hash")
        if built_with != config_hash:
            raise ConfigError(f"{layout.root} was built with another configuration (config hash {built_with}, now "
                              f"{config_hash}): delete {data.parts_dir} and build the parts again")
    return [parts[i] for i in range(count)]
