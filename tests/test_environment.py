"""peagle keeps the user's environment: their Prefect profile and API, their HF cache and token.

Each test runs the installed ``peagle`` command in a fresh process with a temporary HOME
that holds what a user's machine would (a profile written by Prefect's own CLI, a token
file where ``hf auth login`` puts it), and reads what peagle's entry point resolved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FAKE_TOKEN = "hf_FakeTokenOnlyForPeagleEnvironmentTests"
TEAM_API = "http://127.0.0.1:4999/api"


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: HOME is theirs, and none of the suite's Prefect/HF/vLLM isolation leaks in."""
    library_vars = ("PREFECT_", "HF_", "HUGGINGFACE_", "VLLM_", "WANDB_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(library_vars)}
    env.update(HOME=str(home), PEAGLE_HOME=str(home / "peagle-outputs"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc


def peagle_env(env: dict[str, str], cwd: Path) -> tuple[dict, str]:
    """What ``peagle config env`` reports, and its raw output."""
    peagle = BIN / "peagle"
    assert peagle.exists(), f"{peagle}: the peagle command is not installed (make install)"
    out = run([str(peagle), "config", "env"], env, cwd).stdout
    return json.loads(out), out


@pytest.fixture()
def user_home(tmp_path) -> Path:
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text(FAKE_TOKEN)  # where `hf auth login` writes it
    return home


def test_the_users_prefect_profile_and_hf_login_are_used(user_home, tmp_path):
    env = user_env(user_home)
    run([str(BIN / "prefect"), "config", "set", f"PREFECT_API_URL={TEAM_API}"], env, tmp_path)
    assert TEAM_API in (user_home / ".prefect" / "profiles.toml").read_text()

    seen, raw = peagle_env(env, tmp_path)

    assert seen["prefect"]["api_url"] == TEAM_API  # runs go to the user's server, not a throw-away one
    assert seen["prefect"]["home"] == str(user_home / ".prefect")
    assert seen["hf_home"] == str(user_home / ".cache" / "huggingface")  # their cached models are found
    assert seen["hf_token_found"] is True
    assert FAKE_TOKEN not in raw
    assert seen["vllm_cache_root"] is None  # vLLM keeps its own default
    assert seen["peagle_home"] == str(user_home / "peagle-outputs")
    assert not (user_home / "peagle-outputs").exists()  # nothing of a library's is moved in there


def test_without_a_prefect_api_prefect_runs_its_ephemeral_server(user_home, tmp_path):
    seen, _ = peagle_env(user_env(user_home), tmp_path)
    assert seen["prefect"]["api_url"] is None
    assert seen["prefect"]["home"] == str(user_home / ".prefect")


def test_variables_the_user_set_win(user_home, tmp_path):
    env = user_env(user_home, PREFECT_API_URL="http://prefect.example:4200/api",
                   HF_HOME=str(tmp_path / "hf"), HF_TOKEN=FAKE_TOKEN + "Env")
    seen, raw = peagle_env(env, tmp_path)
    assert seen["prefect"]["api_url"] == "http://prefect.example:4200/api"
    assert seen["hf_home"] == str(tmp_path / "hf")
    assert seen["hf_token_found"] is True and FAKE_TOKEN not in raw
