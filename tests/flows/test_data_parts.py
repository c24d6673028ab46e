"""The data stage spread over two hosts as a Prefect user runs it: the session's real `prefect
server`, two real process workers of one pool (`prefect worker start --limit 1`, one flow run at
a time each: two hosts), prefect.yaml's data-part deployment, and the data flow with
``orchestration.data_parts: 2`` run by the orchestrating process (this one).

One run pays for every check: the Magpie requests written once by the data flow before the
parts (a part started before them is refused, naming the command that writes them), the two
parts taken by the two workers at the same time, and one store with every sample once, in
the order of the records, its hidden states the target's, and the served split that part 0
built taken in with them, so the build that takes the parts in starts no engine. Before it, without the deployment
or without a worker online, the data flow is refused before any engine starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.data.test_pipeline import hf_states
from tests.peagle_cli import assert_refused, peagle
from tests.prefect_worker import (
    deployed_on_this_server,
    prefect_cli,
    prefect_worker,
    wait_for_online_workers,
    worker_env,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
POOL = "peagle-process"
DEPLOYMENT = "data-part"
PROMPTS, MAGPIE, HELDOUT = 12, 4, 4


def parts_config(tmp: Path) -> Path:
    """tiny.yaml at its smallest in float32, with a prompt file and a magpie source (as
    configs/demo.yaml has), spread over two parts that each hold a slot of a two-slot
    accelerator limit."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg.update(name="parts", workdir=str(tmp / "run"))
    cfg["target"]["dtype"] = "float32"  # the hidden states checked against the target's own, in float32
    cfg["data"].update(
        sources=[{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"},
                 {"kind": "magpie", "path": str(tmp / "magpie.jsonl"), "max_samples": MAGPIE}],
        max_samples=None, heldout_samples=HELDOUT, shard_max_tokens=512)
    cfg["data"]["regenerate"]["max_tokens"] = 48
    cfg["eval"].update(num_prompts=4, max_tokens=32)
    cfg["orchestration"] = {"data_parts": 2, "accelerator_limit": "peagle-accelerator-parts", "accelerator_slots": 2}
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    path = tmp / "parts.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def part_runs(config_name: str) -> list:
    """The data-part flow runs of one config, by part ("data-part-0/2 parts (embedded)")."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="data-part-")))
    return sorted((r for r in runs if f" {config_name} (" in r.name), key=lambda r: r.name)


def flow_run_logs(name_prefix: str) -> list:
    """The log records of the one completed flow run whose name starts with ``name_prefix``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tests.prefect_worker import logs_of_finished_runs

    with get_client(sync_client=True) as client:
        (run,) = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            like_=name_prefix))) if r.name.startswith(name_prefix) and r.state.is_completed()]
        return logs_of_finished_runs(client, [run.id])


def records_of(info) -> list[dict]:
    """The dataset's samples.jsonl: one record per prompt, in the order one host's build writes."""
    from peagle.layout import DataLayout

    return [json.loads(line) for line in DataLayout(info.data_dir).samples.read_text().splitlines()]


@pytest.mark.timeout(900)  # two workers' flow runs (an engine each, at once) and the data flow's two engines
def test_two_workers_build_the_parts_at_once_into_one_store_with_each_sample_once(
        tmp_path, embedded_target, prefect_server):
    from flows.stages import data_flow
    from peagle.data.store import ShardReader
    from peagle.layout import DataLayout

    config = parts_config(tmp_path)
    refused = peagle("data", config, "--part", "1/2")
    assert_refused(refused, "magpie.jsonl are not written yet", f"peagle data {config} --requests-only")
    assert not (tmp_path / "run" / "data" / "parts").exists()

    with deployed_on_this_server({POOL}, {DEPLOYMENT}):
        with pytest.raises(RuntimeError, match="does not have: deploy it"):  # before any engine starts
            data_flow(str(config))
        env = worker_env(prefect_server, tmp_path)
        prefect_cli(["work-pool", "create", POOL, "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", DEPLOYMENT], env, cwd=REPO)
        with pytest.raises(RuntimeError, match=f"no worker of the work pool '{POOL}'.* online"):
            data_flow(str(config))
        assert not (tmp_path / "magpie.jsonl").exists()
        logs = {host: tmp_path / f"{host}.log" for host in ("host-a", "host-b")}
        with (prefect_worker(POOL, env, logs["host-a"], cwd=REPO, args=("--limit", "1", "--name", "host-a")),
              prefect_worker(POOL, env, logs["host-b"], cwd=REPO, args=("--limit", "1", "--name", "host-b"))):
            wait_for_online_workers(POOL, 2)
            start = time.perf_counter()
            info = data_flow(str(config))
            print(f"\ndata flow over two workers: {time.perf_counter() - start:.0f} s")
            # read while the workers run: a part run's process ships its last lines after its final state
            first_part = " ".join(r.message for r in flow_run_logs("data-part-0/2 parts (embedded)"))

    # The two parts: completed, one on each worker, at the same time.
    runs = part_runs("parts")
    assert [r.name.split()[0] for r in runs] == ["data-part-0/2", "data-part-1/2"], [r.name for r in runs]
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state_name) for r in runs]
    # Who ran a part: the worker whose log holds the part run's own output (both workers may try to
    # submit a run; the server lets one, and the other's submission is aborted).
    took = {host: [part for part in ("0/2", "1/2") if f"data part {part}: " in log.read_text()]
            for host, log in logs.items()}
    assert sorted(sum(took.values(), [])) == ["0/2", "1/2"] and all(len(t) == 1 for t in took.values()), \
        f"each worker is a host of its own and runs one part: {took}"
    first, second = runs
    assert first.start_time < second.end_time and second.start_time < first.end_time, "the parts ran one after the other"

    # The requests written once, before the parts read them; the parts' answers reused (the data
    # flow run's log, as the UI shows it).
    assert len((tmp_path / "magpie.jsonl").read_text().splitlines()) == MAGPIE
    said = " ".join(r.message for r in flow_run_logs("data parts (embedded)"))
    assert f"{PROMPTS + MAGPIE} regenerated responses restored" in said, said
    assert f"{info.num_train + info.num_eval} samples taken in from 2 parts built apart" in said, said
    # The served split built by part 0's engine and taken in: the data flow's build starts none.
    assert "data: served split taken in from" in said and "data: starting vLLM for" not in said, said
    assert "data: served split: 4 eval prompts" in first_part, first_part

    # One store: every record's sample once, in the records' order; the parts are gone.
    data = DataLayout(info.data_dir)
    records = records_of(info)
    assert len(records) == PROMPTS + MAGPIE and len({r["id"] for r in records}) == len(records)
    for split in ("train", "eval"):
        reader = ShardReader(data.split(split))
        assert reader.sample_ids() == [r["id"] for r in records if r["split"] == split and r["status"] == "ok"]
        assert reader.manifest["complete"] and len(set(reader.sample_ids())) == len(reader)
    assert (info.num_train, info.num_eval) == (len(ShardReader(data.train)), len(ShardReader(data.eval)))
    assert not data.parts_dir.exists() and data.build.exists() and data.vocab.exists()
    assert ShardReader(data.split("served")).manifest["complete"]

    # Hidden states of a sample from each part: the target's.
    train = ShardReader(data.train)
    for sample in (train[0], train[len(train) - 1]):
        ref = hf_states(embedded_target, sample.token_ids.tolist(), train.layer_ids)
        assert ((sample.hidden - ref).abs() <= 2**-8 * ref.abs() + 1e-3).all(), sample.id
