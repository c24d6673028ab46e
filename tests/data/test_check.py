"""A dataset's soundness: refused by name before training starts a rank, reported shard by shard
(``peagle data --verify``), and mended by extracting exactly the corrupt shards' samples again
(``peagle data --repair``)."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the data tests' builders (--import-mode=importlib)
from test_pipeline import peagle, small_facts, tiny_data_config, tree_bytes  # noqa: E402
from test_store import flip_bytes, write  # noqa: E402

from peagle.data.check import check_dataset, mend_corrupt_shards  # noqa: E402
from peagle.data.errors import CorruptShardError, MissingDatasetError  # noqa: E402
from peagle.data.store import ShardReader  # noqa: E402
from peagle.layout import DataLayout  # noqa: E402


def test_an_unfinished_split_is_not_trained_on(tmp_path):
    layout = DataLayout(tmp_path / "data")
    write(layout.train, range(10))
    small_facts().save(layout.facts)
    layout.vocab.write_bytes(b"")
    manifest = json.loads(layout.manifest("train").read_text())
    manifest["complete"] = False
    layout.manifest("train").write_text(json.dumps(manifest))
    with pytest.raises(MissingDatasetError, match=r"unfinished \(split\(s\) train.*rerun `peagle data CONFIG`"):
        check_dataset(layout.root)


def test_mending_takes_out_exactly_the_corrupt_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    layout = DataLayout(tmp_path / "data")
    write(layout.train, range(20))
    write(layout.eval, range(100, 104))
    names = sorted(p.name for p in layout.train.glob("shard-*"))
    flip_bytes(layout.train / names[1])
    with pytest.raises(CorruptShardError, match=rf"1 corrupt shard\(s\).*{names[1]}.*peagle data CONFIG --repair"):
        mend_corrupt_shards(layout, mend=False)
    assert (layout.train / names[1]).exists()
    kept = {n: (layout.train / n).read_bytes() for n in names if n != names[1]}
    assert mend_corrupt_shards(layout, mend=True) == 1
    assert sorted(p.name for p in layout.train.glob("shard-*")) == sorted(kept)
    assert {n: (layout.train / n).read_bytes() for n in kept} == kept
    assert len(ShardReader(layout.eval)) == 4 and mend_corrupt_shards(layout, mend=False) == 0


@pytest.mark.slow
@pytest.mark.timeout(600)  # a data stage, then training refused and a repair, each a command of its own (~180 s)
def test_a_corrupt_shard_is_found_before_training_and_repair_fixes_it(tmp_path):
    """16 bytes flipped in one shard of a dataset `peagle data` built: `peagle train` refuses
    before any rank starts, naming the shard and `--repair`; `--verify` reports it; a plain
    rerun refuses too; `--repair` extracts exactly its samples again; training then runs."""
    config, run = tiny_data_config(tmp_path)
    assert (built := peagle("data", config)).returncode == 0, built.stdout
    shards = sorted(p.name for p in run.data.train.glob("shard-*"))
    assert len(shards) >= 3
    bad = run.data.train / shards[1]
    flip_bytes(bad)
    others = {n: b for n, b in tree_bytes(run.data.train).items() if n.startswith("shard-") and n != shards[1]}

    train = peagle("train", config, "--set", "train.recipe.max_steps=1")
    assert train.returncode == 1, train.stdout
    assert f"{bad} (its sha256 does not match the manifest's)" in train.stdout, train.stdout
    assert "`peagle data CONFIG --repair`" in train.stdout
    assert not run.method_checkpoints("peagle").exists()  # no rank started, nothing written

    verify = peagle("data", config, "--verify")
    assert verify.returncode == 1, verify.stdout
    assert "1 corrupt shard(s)" in verify.stdout and str(bad) in verify.stdout
    rows = [line for line in verify.stdout.splitlines() if "│ shard-" in line]
    listed = sum(len(json.loads(m.read_text())["shards"]) for m in run.data.splits_dir.glob("*/manifest.json"))
    assert len(rows) == listed and sum("│ ok" in r for r in rows) == listed - 1
    assert any(f"│ train  │ {shards[1]} │" in r and "corrupt" in r for r in rows), verify.stdout

    plain = peagle("data", config)
    assert plain.returncode == 1 and "--repair" in plain.stdout and "starting vLLM" not in plain.stdout, plain.stdout

    repair = peagle("data", config, "--repair")
    assert repair.returncode == 0, repair.stdout
    lost = int(re.search(rf"1 corrupt shard\(s\) of train removed \({shards[1]}\); their (\d+) samples",
                         repair.stdout).group(1))
    assert re.search(rf"data: {lost} sequences .* to extract", repair.stdout), repair.stdout
    assert "regenerate:" not in repair.stdout
    assert {n: b for n, b in tree_bytes(run.data.train).items() if n in others} == others
    assert len(ShardReader(run.data.train, verify="full")) == json.loads(
        run.data.manifest("train").read_text())["num_samples"]
    assert (verified := peagle("data", config, "--verify")).returncode == 0, verified.stdout

    trained = peagle("train", config, "--set", "train.recipe.max_steps=1")
    assert trained.returncode == 0, trained.stdout
    steps = list(run.method_checkpoints("peagle").glob("*/step-*"))
    assert steps

    from peagle.config import load_config
    from peagle.train.launch import checkpoint_bytes

    estimate = checkpoint_bytes(load_config(config), run.data.root)  # what the disk check reserves per checkpoint
    assert all(sum(f.stat().st_size for f in step.rglob("*") if f.is_file()) <= estimate for step in steps)
