"""The data stage spread over hosts: parts named and sliced, finished parts checked before any
work, and their shards moved into one store with each sample once (the end-to-end run over two
Prefect workers is tests/flows/test_data_parts.py)."""

import json
import logging

import pytest
import torch

from peagle.config import ConfigError
from peagle.data.parts import Part, finished_parts, mark_done, part_layout
from peagle.data.store import ShardReader, ShardWriter
from peagle.layout import DataLayout
from tests.data.test_store import LAYERS, make_sample, write


def test_a_part_is_i_of_n_and_the_parts_cover_every_item_once_in_order():
    assert Part.parse("1/2") == Part(1, 2) and Part.parse(" 0 / 3 ".replace(" ", "")).label == "0-of-3"
    for bad in ("2/2", "1", "a/b", "1-2", "-1/2", "0/0"):
        with pytest.raises(ConfigError, match="I/N"):
            Part.parse(bad)
    for n in range(11):
        items = list(range(n))
        for count in range(1, 5):
            slices = [Part(i, count).take(items) for i in range(count)]
            assert sum(slices, []) == items, (n, count)
            assert max(map(len, slices)) - min(map(len, slices)) <= 1


def finish(data: DataLayout, part: Part, config_hash: str = "h1") -> DataLayout:
    layout = part_layout(data, part)
    layout.root.mkdir(parents=True, exist_ok=True)
    mark_done(layout, part, config_hash, samples=3)
    return layout


def test_finished_parts_are_all_of_one_splitting_complete_and_of_this_config(tmp_path):
    data = DataLayout(tmp_path / "data")
    assert finished_parts(data, "h1") == []  # no part built: the build does everything itself
    first = finish(data, Part(0, 3))
    finish(data, Part(2, 3))
    part_layout(data, Part(1, 3)).root.mkdir()  # started, never finished
    with pytest.raises(ConfigError, match=r"1 of the 3 parts .* `peagle data my.yaml --part 1/3`"):
        finished_parts(data, "h1", "my.yaml")
    middle = finish(data, Part(1, 3))
    assert finished_parts(data, "h1") == [first, middle, part_layout(data, Part(2, 3))]
    with pytest.raises(ConfigError, match=r"another configuration \(config hash h1, now h2\)"):
        finished_parts(data, "h2")
    finish(data, Part(0, 2))
    with pytest.raises(ConfigError, match="parts of 2 splittings"):
        finished_parts(data, "h1")
    (data.parts_dir / "0-of-2").rename(data.parts_dir / "stray")
    with pytest.raises(ConfigError, match="stray is not a part"):
        finished_parts(data, "h1")


def test_adopted_shards_join_the_store_in_part_order_each_sample_once(tmp_path, caplog):
    write(tmp_path / "part0", range(0, 12), shard_max_tokens=500)
    write(tmp_path / "part1", range(12, 20), shard_max_tokens=500)
    with ShardWriter(tmp_path / "store", LAYERS, 64, "bfloat16", 500, {"config_hash": "h1"}) as w:
        assert w.adopt(tmp_path / "part0") == 12 and w.adopt(tmp_path / "part1") == 8
        assert w.adopt(tmp_path / "part0") == 0  # a rerun: everything listed there is here already
        w.add(*make_sample(20))  # the build's own samples follow
    reader = ShardReader(tmp_path / "store")
    assert reader.sample_ids() == [f"s{i:04d}" for i in range(21)]
    assert reader.num_tokens == sum(make_sample(i)[1].numel() for i in range(21))
    for i in (0, 11, 12, 20):
        assert torch.equal(reader[i].token_ids, make_sample(i)[1])
        assert torch.allclose(reader[i].hidden, make_sample(i)[3], rtol=2**-8, atol=1e-6)
    assert not list((tmp_path / "part0").glob("shard-*"))  # moved, not copied

    # A crash between the move and the part's cleanup: the listed file is gone; the store holds it.
    write(tmp_path / "part2", range(30, 40), shard_max_tokens=500)
    manifest = json.loads((tmp_path / "part2" / "manifest.json").read_text())
    (tmp_path / "part2" / manifest["shards"][0]["file"]).unlink()
    caplog.set_level(logging.WARNING, logger="peagle.data.store")
    with ShardWriter(tmp_path / "store", LAYERS, 64, "bfloat16", 500, {"config_hash": "h1"}) as w:
        assert w.adopt(tmp_path / "part2") == 10 - manifest["shards"][0]["samples"]
    assert "listed but gone" in caplog.text  # those samples are not in the store: the build extracts them

    write(tmp_path / "overlap", [20, 41], shard_max_tokens=10_000)  # one shard: one sample held, one not
    write(tmp_path / "other", range(50, 52), meta={"config_hash": "h2"})
    with ShardWriter(tmp_path / "store", LAYERS, 64, "bfloat16", 500, {"config_hash": "h1"}) as w:
        with pytest.raises(ValueError, match="never stored twice"):
            w.adopt(tmp_path / "overlap")
        with pytest.raises(ValueError, match=r"other settings .*config_hash: 'h2' there, 'h1' here"):
            w.adopt(tmp_path / "other")
