"""Talking to a `peagle serve` (vLLM's OpenAI server) as a registry consumer does: wait for
peagle's own "ready:" line, ask over HTTP, read vLLM's speculative-decoding counters from
``/metrics``, and stop the server with everything it started.

    server = subprocess.Popen([... "peagle", "serve", head, "--port", port], stdout=log, ...)
    try:
        wait_for_ready_line(server, log, url)
        before = spec_decode_counters(url)
        http_json(f"{url}/v1/chat/completions", {...})
    finally:
        assert not stop_tree(server)
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from peagle.serving.metrics import ACCEPTED, DRAFT_TOKENS, DRAFTS, SpecDecodeStats


def wait_for_ready_line(server: subprocess.Popen, log: Path, url: str, timeout_s: float = 600) -> None:
    """Wait for the line the user waits for (``ready: URL/v1``); fail with the log's tail if the
    server exits or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    while f"ready: {url}/v1" not in log.read_text(errors="replace"):
        assert server.poll() is None, f"peagle serve exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"peagle serve not ready after {timeout_s:.0f} s: {log.read_text()[-3000:]}"
        time.sleep(2)


def http_json(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def spec_decode_counters(base_url: str) -> SpecDecodeStats:
    """vLLM's spec-decode counters as Prometheus exposes them, summed over engines (take the
    ``peagle.serving.metrics.delta`` of two reads)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED), 0)
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return SpecDecodeStats(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED])


def stop_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGTERM `peagle serve` (it stops its vLLM server); returns processes still alive after 90 s."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)] if proc.poll() is None else []
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=90)
    for p in alive:
        p.kill()
    return alive
