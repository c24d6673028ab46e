"""The ``peagle`` command: one sub-command per stage, and ``run`` for the whole Prefect flow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.table import Table

from peagle.config import ConfigError, load_config
from peagle.paths import configure_environment

app = typer.Typer(help="Train P-EAGLE drafter heads and publish them ready for vLLM.", no_args_is_help=True)
target_app = typer.Typer(help="The target model.", no_args_is_help=True)
config_app = typer.Typer(help="Pipeline configs.", no_args_is_help=True)
app.add_typer(target_app, name="target")
app.add_typer(config_app, name="config")
console = Console(width=None if sys.stdout.isatty() else 120)

ConfigArg = typer.Argument(..., help="A pipeline config YAML, e.g. configs/demo.yaml")
SetOpt = typer.Option(None, "--set", help="Override a config key: --set train.epochs=3 (YAML value)")


def _parse_overrides(pairs: list[str] | None) -> dict:
    overrides = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise typer.BadParameter(f"--set {pair!r}: expected KEY=VALUE, e.g. train.epochs=3")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def _load(config: Path, overrides: list[str] | None = None):
    try:
        return load_config(config, _parse_overrides(overrides))
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None


@config_app.command("check")
def config_check(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Validate a config (types, unknown keys, impossible combinations) without running anything."""
    cfg = _load(config, set_)
    console.print(f"[green]{config}: valid[/green] (run directory {cfg.run_dir})")


@target_app.command("build")
def target_build(
    config: Path = typer.Option(Path("configs/demo.yaml"), help="Config whose target.embedded recipe to build"),
    force: bool = typer.Option(False, help="Rebuild even if a cached build exists"),
):
    """Build (or reuse) the embedded default target: a small code LM trained offline."""
    cfg = _load(config)
    configure_environment()
    from peagle.target import build_embedded_target

    path = build_embedded_target(cfg.target.embedded, force=force)
    report = json.loads((path / "build_report.json").read_text())
    console.print(f"target: {path}")
    console.print_json(json.dumps(report))


@app.command("data")
def data_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt, force: bool = typer.Option(False)):
    """Generate the hidden-state dataset (regeneration and extraction through vLLM)."""
    from peagle import pipeline as stages

    cfg = _load(config, set_)
    info = stages.generate_data(cfg, stages.prepare_target(cfg), force=force)
    console.print(stages.summary_json(info))


@app.command("train")
def train_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    method: str = typer.Option(None, help="peagle (default) or eagle3"),
):
    """Train the drafter with DeepSpeed on the run's dataset (resumes from its last checkpoint)."""
    from peagle import pipeline as stages

    cfg = _load(config, set_)
    result = stages.train_head(cfg, stages.prepare_target(cfg), cfg.run_dir / "data", method=method)
    console.print(stages.summary_json(result))


@app.command("export")
def export_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    method: str = typer.Option("peagle", help="peagle or eagle3: which trained head to export"),
    checkpoint: Path = typer.Option(None, help="A checkpoint dir (default: the best by offline acceptance)"),
    vllm_check: bool = typer.Option(True, help="Also load the head in vLLM and draft before publishing"),
):
    """Export a checkpoint as a head directory vLLM serves; refuses a head that fails validation."""
    from peagle import pipeline as stages
    from peagle.export.validate import validate_head

    cfg = _load(config, set_)
    target = stages.prepare_target(cfg)
    ckpt = checkpoint or stages.checkpoint_dir(cfg, method) / "best"
    head = stages.export_head(cfg, target, cfg.run_dir / "data", ckpt, method=method)
    if vllm_check:
        validate_head(head, target.path, vllm_cfg=cfg.vllm, parallel_drafting=method == "peagle")
    console.print(f"head: {head}")


@app.command("evaluate")
def evaluate_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Acceptance per K and tokens/s in vLLM for the run's exported heads, against the baseline."""
    from peagle import pipeline as stages

    cfg = _load(config, set_)
    target = stages.prepare_target(cfg)
    labels = {"peagle": stages.PEAGLE_LABEL, "eagle3": stages.EAGLE3_LABEL}
    heads = {label: cfg.run_dir / "heads" / m for m, label in labels.items() if (cfg.run_dir / "heads" / m).exists()}
    if not heads:
        console.print(f"[red]no exported head under {cfg.run_dir / 'heads'}: run `peagle export` first[/red]")
        raise typer.Exit(2)
    online = stages.evaluate_online(cfg, target, heads)
    console.print(online.to_table())
    from peagle.eval.plots import plot_online

    out = cfg.run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"plot: {plot_online(online, out / 'online_acceptance.png')}")
    console.print(f"table: {online.save(out / 'online_results.json')}")


@app.command("run")
def run_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Run the whole pipeline as a Prefect flow and print acceptance per K."""
    cfg = _load(config, set_)  # fail on a bad config before Prefect starts
    configure_environment()
    from flows.pipeline import pipeline_flow

    result = pipeline_flow(config_path=str(config), overrides=_parse_overrides(set_))
    print_summary(result)
    del cfg


@app.command("deploy")
def deploy_cmd(
    prefect_file: Path = typer.Option(Path("prefect.yaml"), help="The Prefect deployments file"),
    name: list[str] = typer.Option(None, "--name", help="Only these deployments (repeatable); default: all"),
    check: bool = typer.Option(False, help="Only validate the file and the flows' parameters; register nothing"),
):
    """Register the Prefect deployments (and create their work pools) on PREFECT_API_URL's server."""
    configure_environment()
    from flows.deploy import deploy, load_prefect_file

    if check:
        specs = load_prefect_file(prefect_file)
        for s in specs:
            console.print(f"[green]ok[/green] {s.name}: {s.entrypoint} on {s.work_pool}"
                          + (f", cron {', '.join(c.cron for c in s.schedules)}" if s.schedules else ""))
        return
    ids = deploy(prefect_file, name or None)
    console.print(f"registered {len(ids)} deployments from {prefect_file}")


@app.command("retrain")
def retrain_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt,
                force: bool = typer.Option(False, help="Retrain even when nothing changed"),
                warm_start: bool = typer.Option(False, help="Start from the champion's weights (train.init_from)")):
    """Retrain only if the prompts, target or config changed since the champion; promote if better."""
    _load(config, set_)
    configure_environment()
    from flows.retrain import retrain_flow

    result = retrain_flow(config_path=str(config), overrides=_parse_overrides(set_), force=force,
                          warm_start=warm_start)
    console.print(result.message)
    if result.pipeline is not None:
        print_summary(result.pipeline)


def print_summary(result) -> None:
    console.print(result.online.to_table(title="Acceptance length and output tokens/s in vLLM"))
    offline = result.offline.acceptance_length
    console.print("offline acceptance (held-out): " + ", ".join(f"K={k}: {v:.2f}" for k, v in offline.items()))
    table = Table(title="Stage timings (s)")
    for name in result.stage_seconds:
        table.add_column(name, justify="right")
    table.add_row(*[f"{s:.0f}" for s in result.stage_seconds.values()])
    console.print(table)
    console.print(f"head:        {result.head_dir}")
    console.print(f"plot:        {result.plot}")
    console.print(f"checkpoint:  {result.checkpoint_dir}")
    console.print(f"MLflow run:  {result.mlflow_run_url}")
    if result.model_version:
        verdict = "champion" if result.promotion.promoted else "challenger"
        console.print(f"registered:  version {result.model_version} -> {verdict} ({result.promotion.reason})")


def main() -> None:
    from peagle.logs import show_on_console

    show_on_console()  # peagle's own progress lines; libraries' output goes to the run's log file
    try:
        app()
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        sys.exit(2)


if __name__ == "__main__":
    main()
