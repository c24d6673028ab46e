"""CI lint of docker/: the compose file against the compose-spec JSON schema (vendored by
check-jsonschema), yamllint on the YAML, and a parse of both Dockerfiles with checks of
what they must hold. No Docker engine needed (this machine has none)."""

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def compose_schema_errors(doc: dict) -> list[str]:
    import check_jsonschema.builtin_schemas as builtin
    import jsonschema

    schema_path = Path(list(builtin.__path__)[0]) / "vendor" / "compose-spec.json"
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)  # the draft the schema declares (2020-12)
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_matches_the_compose_spec():
    assert compose_schema_errors(compose()) == []


def test_compose_schema_check_catches_a_typo():
    doc = compose()
    doc["services"]["mlflow"]["helthcheck"] = doc["services"]["mlflow"].pop("healthcheck")
    assert any("helthcheck" in e for e in compose_schema_errors(doc))


def test_every_long_running_service_has_a_health_check():
    services = compose()["services"]
    assert {"postgres", "mlflow", "prefect-server", "worker", "gpu-worker"} <= set(services)
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    assert services["worker"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    gpu = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]


def test_compose_keeps_secrets_out_of_the_file():
    text = (DOCKER / "compose.yaml").read_text()
    for match in re.finditer(r"^\s*[A-Z_]*(PASSWORD|TOKEN|SECRET)[A-Z_]*:\s*(\S+)", text, re.MULTILINE):
        assert match.group(2).startswith(("${", ">-")), f"hard-coded secret: {match.group(0)}"


@pytest.mark.parametrize("path", ["docker/compose.yaml", "prefect.yaml", "docker/yamllint.yaml"])
def test_yamllint(path):
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(file=str(DOCKER / "yamllint.yaml"))
    problems = [f"{p.line}:{p.column} {p.message}" for p in linter.run((REPO / path).read_text(), config)
                if p.level == "error"]
    assert problems == []


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_parses_and_holds_what_the_stack_needs(name):
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=open(DOCKER / name, "rb"))
    instructions = [i["instruction"] for i in parser.structure if i["instruction"] != "COMMENT"]
    assert [i for i in instructions if i != "ARG"][0] == "FROM"
    assert ":" in parser.baseimage and not parser.baseimage.endswith(":latest")
    assert {"HEALTHCHECK", "CMD", "WORKDIR"} <= set(instructions)
    env = parser.envs
    assert env["PEAGLE_HOME"] == "/var/lib/peagle" and env["PEAGLE_REPO"] == "/opt/peagle"
    assert not any(re.search("TOKEN|PASSWORD|SECRET", k) for k in env), "secrets belong in the runtime env"
    for item in parser.structure:
        if item["instruction"] == "COPY":
            *sources, _ = item["value"].split()
            for src in sources:
                assert (REPO / src).exists(), f"{name}: COPY {src} does not exist in the repository"
        if item["instruction"] == "RUN":
            assert not item["value"].rstrip().endswith("|| true"), f"{name}: a RUN that cannot fail"


# The ENTRYPOINT each base image sets (docker inspect); an image inherits it unless it resets it.
BASE_ENTRYPOINTS = {"python": [], "vllm/vllm-openai": ["vllm", "serve"]}
WORKER_COMMAND = ["prefect", "flow-run", "execute"]  # what Prefect's docker/Kubernetes workers run


def container_argv(name: str, command: list[str] | None) -> list[str]:
    """What a container of the image runs, by Docker's rule: ENTRYPOINT + (the given command or CMD)."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=open(DOCKER / name, "rb"))
    entrypoint = BASE_ENTRYPOINTS[parser.baseimage.split(":")[0]]
    cmd = None
    for item in parser.structure:
        if item["instruction"] == "ENTRYPOINT":
            entrypoint, cmd = json.loads(item["value"]), None  # a new ENTRYPOINT also resets CMD
        elif item["instruction"] == "CMD":
            cmd = json.loads(item["value"])
    return entrypoint + (command if command else cmd or [])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_the_workers_command_runs_as_given(name):
    """No ENTRYPOINT captures `prefect flow-run execute` (it once became `peagle prefect flow-run execute`)."""
    assert container_argv(name, WORKER_COMMAND) == WORKER_COMMAND
    assert container_argv(name, None) == ["peagle", "--help"]  # `docker run IMAGE` alone
    assert container_argv(name, ["peagle", "run", "configs/demo.yaml"])[0] == "peagle"


def test_compose_workers_give_their_command_not_an_entrypoint():
    for name in ("worker", "gpu-worker"):
        service = compose()["services"][name]
        assert "entrypoint" not in service
        assert service["command"][:3] == ["prefect", "worker", "start"]
        assert "shm_size" in service  # vLLM refuses Docker's 64 MiB /dev/shm, on CPU too
