"""Retry rules (run through Prefect's real retry machinery), lineage comparison, artifacts."""

import json

import pytest

from flows.common import acceptance_markdown, artifact_key, is_transient


def test_engine_start_and_connection_errors_are_transient():
    from mlflow.exceptions import MlflowException

    from peagle.serving.engine import EngineStartError

    assert is_transient(EngineStartError("engine core died during start-up"))
    assert is_transient(ConnectionRefusedError(111, "Connection refused"))
    assert is_transient(MlflowException("API request to http://mlflow:5000 failed: Max retries exceeded"))
    wrapped = RuntimeError("stage failed")
    wrapped.__cause__ = EngineStartError("busy device")
    assert is_transient(wrapped)
    assert not is_transient(ValueError("data.max_seq_len must be below vllm.max_model_len"))
    assert not is_transient(MlflowException("RESOURCE_DOES_NOT_EXIST: registered model"))


def test_a_tracking_server_that_does_not_answer_is_transient_a_missing_vllm_is_not():
    from peagle.services import ServiceUnavailable
    from peagle.tracking.mlflow_run import require_tracking_server
    from tests.mlflow_server import free_port

    with pytest.raises(ServiceUnavailable) as down:
        require_tracking_server(f"http://127.0.0.1:{free_port()}")
    assert is_transient(down.value)
    assert not is_transient(ServiceUnavailable("vLLM", "cannot be imported", "`make install` installs it"))


def flaky_flow(exc_type, fail_times: int):
    """A flow whose task (with the stage tasks' retry options) fails ``fail_times`` times first."""
    from prefect import flow, task

    from flows.common import retry_if_transient

    calls = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_if_transient)
    def start_engine():
        calls.append(1)
        if len(calls) <= fail_times:
            raise exc_type("simulated start-up failure")
        return "started"

    @flow
    def run():
        return start_engine()

    return run, calls


def test_a_transient_failure_is_retried(prefect_server):
    from peagle.serving.engine import EngineStartError

    run, calls = flaky_flow(EngineStartError, fail_times=1)
    assert run() == "started"
    assert len(calls) == 2


def test_a_config_error_is_not_retried(prefect_server):
    run, calls = flaky_flow(ValueError, fail_times=1)
    state = run(return_state=True)
    assert state.is_failed()
    assert len(calls) == 1


def test_changes_since_names_what_changed():
    from peagle.lineage import changes_since

    recorded = {"data_config_hash": "a", "train_config_hash": "t", "target_revision": "r1",
                "prompt_files": json.dumps({"p.jsonl": "h1"})}
    assert changes_since(recorded, dict(recorded)) == []
    grown = {**recorded, "prompt_files": json.dumps({"p.jsonl": "h2", "q.jsonl": "h3"}), "target_revision": "r2"}
    changes = changes_since(recorded, grown)
    assert "prompt file p.jsonl changed (new prompt data)" in changes
    assert "new prompt source q.jsonl" in changes
    assert any(c.startswith("target revision changed") for c in changes)
    assert changes_since({}, recorded)[0].startswith("the champion has no recorded lineage")


def test_acceptance_markdown_and_artifact_keys():
    from peagle.eval.online import TABLE_CAPTION, OnlineResult, OnlineRow

    online = OnlineResult(target="t", max_tokens=32, prompt_set="code_eval", rows=[
        OnlineRow("baseline", 0, 1, 4, 128, 2.0, 64.0),
        # 125 decode tokens: a head's 50 steps; n-gram lookup's 107 steps, or up to 8 more (2 a request)
        OnlineRow("ngram", 2, 1, 4, 129, 1.0, 100.0, acceptance_length=2.8, num_drafts=10, num_accepted_tokens=18),
        OnlineRow("p-eagle", 2, 1, 4, 129, 1.0, 128.0, acceptance_length=2.5, num_drafts=50, num_accepted_tokens=75),
    ])
    text = acceptance_markdown(online)
    assert "| method | K | concurrency | tokens/step | vLLM acc. length | output tok/s | speedup |" in text
    assert "| baseline | 0 | 1 | 1.00 | - | 64.0 | 1.00x |" in text
    assert "| ngram | 2 | 1 | 1.09-1.17 | 2.800 | 100.0 | 1.56x |" in text
    assert "| p-eagle | 2 | 1 | 2.50 | 2.500 | 128.0 | 2.00x |" in text
    assert text.endswith(TABLE_CAPTION)
    assert artifact_key("Qwen3_8B", "acceptance") == "qwen3-8b-acceptance"


@pytest.mark.parametrize("bad", ["../etc", "x" * 300])
def test_artifact_keys_are_always_valid(bad):
    key = artifact_key(bad)
    assert len(key) <= 100 and all(c.isalnum() or c == "-" for c in key)


def test_a_bookkeeping_change_does_not_make_retraining_retrain(prefect_server, embedded_target, tmp_path):
    """The champion's lineage was recorded under keep_last=2; keep_last=9 is the same head."""
    from flows.retrain import retrain_flow
    from peagle.config import load_config
    from tests.champions import register_champion_trained_on

    config = "configs/tiny.yaml"
    overrides = {"workdir": str(tmp_path / "run"), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    register_champion_trained_on(load_config(config, overrides), overrides["tracking.tracking_uri"], tmp_path)

    result = retrain_flow(config, {**overrides, "train.checkpoints.keep_last": 9, "train.checkpoints.eval_every": 50})
    assert not result.retrained and result.pipeline is None and "nothing new" in result.message
    assert not (tmp_path / "run" / "revisions").exists()


# ----------------------------------------------------------------------------- names, parameters, limits


def demo_config(tmp_path, **overrides):
    from peagle.config import load_config

    return load_config(REPO / "configs" / "tiny.yaml", {"workdir": str(tmp_path / "run"), **overrides})


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_stage_time_limits_come_from_the_config(tmp_path):
    from flows.stages import limits

    cfg = demo_config(tmp_path, **{"orchestration.timeouts_s.train": 600})
    assert limits(cfg, "train", cached=True) == {"timeout_seconds": 600,
                                                 "result_storage": cfg.run_dir / "prefect-results"}
    assert limits(cfg, "data")["timeout_seconds"] == 24 * 3600  # generous defaults


def test_runs_are_named_by_stage_config_and_target(prefect_server, tmp_path):
    from prefect import flow

    from flows.common import run_namer
    from peagle.config import write_resolved_config

    @flow(flow_run_name=run_namer("train-{method}"))
    def named(config: str, method: str | None = None):
        from prefect.runtime import flow_run

        return flow_run.name

    path = str(write_resolved_config(demo_config(tmp_path, name="nightly")))
    assert named(path) == "train-peagle nightly (embedded)"
    assert named(path, method="eagle3") == "train-eagle3 nightly (embedded)"
    assert named(str(tmp_path / "missing.yaml")) == "train missing"  # the flow itself reports the bad path


@pytest.mark.slow
def test_two_runs_on_one_accelerator_queue(prefect_server, tmp_path):
    """The accelerator limit is created when missing; two holders never overlap."""
    import contextvars
    import threading
    import time

    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows.common import ensure_accelerator_limit, on_accelerator

    cfg = demo_config(tmp_path, **{"orchestration.accelerator_limit": "test-accelerator"})
    ensure_accelerator_limit(cfg)
    ensure_accelerator_limit(cfg)  # idempotent
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("test-accelerator").limit == 1
    spans = []

    @flow
    def gpu_stage(label: str):
        with on_accelerator(cfg):
            start = time.monotonic()
            time.sleep(2)
            spans.append((start, time.monotonic(), label))

    # a new thread starts from Prefect's import-time settings: give each this test's (the session server)
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(gpu_stage, label)) for label in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    (s1, e1, _), (s2, e2, _) = sorted(spans)
    assert len(spans) == 2 and s2 >= e1  # the second waited for the first to release the slot


@pytest.mark.slow
def test_a_slot_left_taken_is_reported_with_the_command_that_frees_it(prefect_server, tmp_path):
    """A killed run's slot (taken in the database, no lease behind it) makes the next stage say
    in its run log why it waits and how to free it; running that command lets the stage run."""
    import contextvars
    import logging
    import subprocess
    import threading
    import time

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    from flows.common import ensure_accelerator_limit, on_accelerator

    name = "test-stale-accelerator"
    cfg = demo_config(tmp_path, **{"orchestration.accelerator_limit": name})
    ensure_accelerator_limit(cfg)
    with get_client(sync_client=True) as client:  # what a SIGKILLed holder on a temporary server leaves
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=1))
    ran = threading.Event()
    notices: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "--active-slots" in record.getMessage():
                notices.append(record.getMessage())

    @flow
    def gpu_stage():
        with on_accelerator(cfg, notice_after_s=2):
            ran.set()

    handler, run_log = Collect(), logging.getLogger("prefect.flow_runs")
    run_log.addHandler(handler)
    try:
        stage = threading.Thread(target=contextvars.copy_context().run, args=(gpu_stage,), daemon=True)
        stage.start()
        deadline = time.monotonic() + 60
        while not notices and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        run_log.removeHandler(handler)
    assert notices, "no notice in the run log after 60 s of waiting"
    assert f"limit {name!r} (1 of 1 taken)" in notices[0] and not ran.is_set()
    command = notices[0].rsplit(": ", 1)[1].split()  # the user's fix, run as printed
    assert command[:2] == ["prefect", "gcl"]
    from tests.prefect_server import PREFECT

    done = subprocess.run([PREFECT, *command[1:]], env=prefect_server.env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    stage.join(timeout=120)
    assert ran.is_set()
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(name).active_slots == 0  # released after the stage
