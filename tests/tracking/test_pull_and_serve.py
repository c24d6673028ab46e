"""A registry consumer, end to end: `peagle pull models:/<name>@champion DIR` from a real
`mlflow server`, `peagle serve DIR` (vLLM's OpenAI server), chat requests over HTTP, and
vLLM's own speculative-decoding counters read from `/metrics`.

The head is the golden head of peagle.export.selftest: its marker target always emits one
token and the head always drafts it, so a head that vLLM loads right accepts every draft.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from peagle.config import TrackingConfig
from peagle.export.card import read_serve_line
from peagle.export.selftest import build_golden_pair
from peagle.tracking.gate import promote_if_better
from peagle.tracking.mlflow_run import Tracker
from peagle.tracking.registry import TAG_TARGET, register_head

pytestmark = pytest.mark.slow
K = 5  # what the exported card advertises (no acceptance measured: the paper's serving K)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def champion(mlflow_server, tmp_path_factory):
    """A golden head registered on the server as the champion; its target recorded as a local path
    of the training machine (as for the embedded target), so the consumer must name its own."""
    target, head = build_golden_pair(tmp_path_factory.mktemp("golden"))
    tracking = TrackingConfig(tracking_uri=mlflow_server, registered_model="peagle-golden")
    with Tracker(tracking, str(target), run_name="consumer") as tracker:
        name = tracker.registered_model_name
        version = register_head(tracker, tracker.run_id, head, name, tags={TAG_TARGET: str(target)},
                                metrics={"score": K + 1.0})
        assert promote_if_better(tracker, name, version.version, K + 1.0, 0.0, validated=True).promoted
    return name, target


def peagle(*args: str, env: dict, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "peagle.cli", *args]
    if kwargs.pop("background", False):
        return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **kwargs)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def consumer_env(mlflow_server: str, tmp_path: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server, "PYTHONPATH": str(REPO),
            "PEAGLE_HOME": str(tmp_path / "home"), "VLLM_CPU_KVCACHE_SPACE": "1"}


def http_json(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def spec_decode_counters(base_url: str) -> dict[str, float]:
    """vLLM's spec-decode counters as Prometheus exposes them, summed over engines."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    wanted = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens"}
    totals = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def stop_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGTERM `peagle serve` (it stops its vLLM server); returns processes still alive after 90 s."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)] if proc.poll() is None else []
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=90)
    for p in alive:
        p.kill()
    return alive


def test_pull_the_champion_and_serve_it_with_vllm(champion, mlflow_server, tmp_path, free_port):
    name, target = champion
    env = consumer_env(mlflow_server, tmp_path)
    head_dir = tmp_path / "pulled" / "head"

    refused = peagle("pull", f"models:/{name}@champion", str(head_dir), env=env)
    assert refused.returncode == 2 and "not a hub id; pass --target" in refused.stdout, refused.stdout + refused.stderr
    assert not head_dir.exists()

    pulled = peagle("pull", f"models:/{name}@champion", str(head_dir), "--target", str(target), env=env)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert f"peagle serve {head_dir}" in pulled.stdout
    line = read_serve_line((head_dir / "README.md").read_text())
    assert (line.target_ref, line.head_ref, line.k, line.parallel_drafting) == (str(target), str(head_dir), K, True)

    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{free_port}"
    with open(log, "wb") as out:
        server = peagle("serve", str(head_dir), "--port", str(free_port), "--",
                        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
                        env=env, background=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        # the user waits for peagle's own "ready:" line, then talks to the server
        deadline = time.monotonic() + 600
        while f"ready: {url}/v1" not in log.read_text(errors="replace"):
            assert server.poll() is None, f"peagle serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"peagle serve not ready after 600 s: {log.read_text()[-3000:]}"
            time.sleep(2)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
            assert health.status == 200
        model = http_json(f"{url}/v1/models")["data"][0]["id"]
        assert model == name  # the registered head's name, from the pulled card
        before = spec_decode_counters(url)
        for question in ("Write a Python function that reverses a list.", "What does a hash map do?"):
            reply = http_json(f"{url}/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": question}],
                "max_tokens": 48, "temperature": 0, "ignore_eos": True})
            assert reply["usage"]["completion_tokens"] == 48
        after = spec_decode_counters(url)
    finally:
        leftovers = stop_tree(server)
    assert not leftovers, f"peagle serve left {leftovers} running"

    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    draft_tokens = after["vllm:spec_decode_num_draft_tokens"] - before["vllm:spec_decode_num_draft_tokens"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    acceptance_length = 1 + accepted / drafts if drafts else 0.0
    print(f"served champion: {drafts:.0f} drafts, {draft_tokens:.0f} draft tokens, {accepted:.0f} accepted, "
          f"acceptance length {acceptance_length:.2f} at K={K}")
    assert drafts > 0
    assert draft_tokens == K * drafts  # parallel drafting: K tokens per draft
    assert acceptance_length > 1.5
