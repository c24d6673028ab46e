"""The ``peagle`` command: one sub-command per stage, and ``run`` for the whole Prefect flow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from peagle import stages
from peagle.catalogue import available_methods, describe
from peagle.config import INIT_FROM_CHAMPION, ConfigError, TrackingConfig, VllmConfig, load_config, parse_overrides
from peagle.contract import CONFIG_FILE
from peagle.data.errors import CorruptShardError, DiskSpaceError
from peagle.data.parts import Part
from peagle.interrupt import interrupted, record_interrupts
from peagle.layout import RunLayout
from peagle.logs import ROOT, run_library_output, show_on_console
from peagle.paths import configure_environment, library_homes, mark_absent
from peagle.services import EXIT_UNAVAILABLE, ServiceUnavailable
from peagle.serving.engine import EngineStartError, require_vllm
from peagle.stages import check_config, summary_json

app = typer.Typer(help="Train P-EAGLE drafter heads and publish them ready for vLLM.", no_args_is_help=True)
target_app = typer.Typer(help="The target model.", no_args_is_help=True)
config_app = typer.Typer(help="Pipeline configs.", no_args_is_help=True)
app.add_typer(target_app, name="target")
app.add_typer(config_app, name="config")
console = Console(width=None if sys.stdout.isatty() else 120)


def print_result(result) -> None:
    """A stage's result as JSON through rich's JSON printer, as ``config env`` prints: it keeps a
    long run directory whole where plain printing wrapped it at the console's width and broke the
    JSON a script reads (``| jq``)."""
    console.print_json(summary_json(result))


ConfigArg = typer.Argument(..., help="A pipeline config YAML, e.g. configs/demo.yaml")
SetOpt = typer.Option(None, "--set", help="Override a config key: --set train.recipe.epochs=3 (YAML value)")


def _load(config: Path, overrides: list[str] | None = None):
    try:
        return load_config(config, parse_overrides(overrides))
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None


def _method(method: str | None, cfg) -> str:
    """``--method`` (default ``train.method``), checked before any work."""
    try:
        return describe(method or cfg.train.method).name
    except ValueError as err:
        console.print(f"[red]--method: {err}[/red]")
        raise typer.Exit(2) from None


def _library_output(cfg):
    """vLLM's, DeepSpeed's, torch's and transformers' output of a stage command into the run's
    library log (``RunLayout.library_log``); our own lines and progress bars stay on the console."""
    import logging


    logging.getLogger(ROOT).info("library output (vLLM, DeepSpeed, torch) goes to %s", RunLayout(cfg.run_dir).library_log)
    return run_library_output(cfg.run_dir)


@config_app.command("check")
def config_check(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Check a config against everything it names, without an engine or a download: types, keys
    and combinations; the target (its tokenizer and the mask token); every prompt source and
    evaluation set; the counts; the run directory. Then its plan: samples, tokens and disk, stored
    or streamed (data.hidden_states), against the free disk (a dataset that cannot fit is
    refused), and for a GPU config (train.recipe.precision bf16) training's GPU hours."""
    cfg = _load(config, set_)  # a config that does not parse is refused before the checks' libraries load

    try:
        report = check_config(cfg)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    for note in report.notes:
        console.print(f"not checked here: {note}", soft_wrap=True)
    for line in report.plan:
        console.print(f"plan: {line}", soft_wrap=True)
    console.print(f"[green]{config}: valid[/green] (run directory {cfg.run_dir})")


def _one_engine(cfg):
    """The engine settings of a command that starts one engine (export's check, evaluate, serve):
    ``vllm.data_parallel_size`` is the data stage's alone."""
    return cfg.vllm.model_copy(update={"data_parallel_size": 1})


def _require(*, vllm=None, tracking=None, prefect: bool = False) -> None:
    """The services a command needs, checked before any of its work (``peagle.services``): vLLM
    and the devices ``vllm`` (a VllmConfig) asks for, the MLflow server of ``tracking`` (a
    TrackingConfig), the Prefect API. ``main`` prints the one that is missing."""
    if vllm is not None:

        require_vllm(vllm)
    if tracking is not None:
        from peagle.tracking.mlflow_run import require_tracking_server, resolve_tracking_uri

        require_tracking_server(resolve_tracking_uri(tracking))
    if prefect:
        from flows import require_prefect_api

        require_prefect_api()


@config_app.command("env")
def config_env():
    """Show where this process reads and writes: peagle's home, the HF cache and token, the Prefect API."""
    from flows import prefect_settings

    console.print_json(json.dumps({**library_homes(), "prefect": prefect_settings()}))


@target_app.command("import-gguf")
def target_import_gguf(
    source: str = typer.Argument(..., help="A .gguf file, or package:NAME for the one an installed package ships"),
    out: Path = typer.Argument(..., help="The model directory to write; point target.model at it"),
    dtype: str = typer.Option("bfloat16", help="Weights dtype of the written directory"),
    force: bool = typer.Option(False, help="Rewrite even if OUT already holds this file's import"),
):
    """A local model directory (safetensors, tokenizer, chat template) from a GGUF file, offline."""
    from peagle.target.gguf import import_gguf, packaged_gguf

    path = packaged_gguf(source.removeprefix("package:")) if source.startswith("package:") else Path(source)
    written = import_gguf(path, out, dtype=dtype, force=force)
    console.print(f"target: {written.resolve()}  (set target.model to this path)")


@app.command("data")
def data_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    force: bool = typer.Option(False, help="Build this configuration's dataset even though the run holds one of "
                               "another (it stays until the new one is complete), extract corrupt shards' samples "
                               "again, and write even when the disk looks too small"),
    repair: bool = typer.Option(False, help="Extract the samples of corrupt shards again (see --verify); nothing "
                                "else is redone"),
    verify: bool = typer.Option(False, help="Hash every shard of the run's dataset and report each; build nothing"),
    part: str | None = typer.Option(None, metavar="I/N", help="Build only part I of N (0-based) of the dataset, "
                                    "on this host, beside it; once all N are done, `peagle data` without --part "
                                    "takes them into one dataset (docs/scale-out.md)"),
    requests_only: bool = typer.Option(False, help="Only write the Magpie requests of kind: magpie sources, once, "
                                       "before the parts (--part) of several hosts read them"),
):
    """Generate the hidden-state dataset (regeneration and extraction through vLLM)."""
    cfg = _load(config, set_)
    if part is not None:

        Part.parse(part)  # a bad --part is refused before any work
    if verify:
        if force or repair or part or requests_only:
            console.print("[red]--verify only reports; run --repair, --force, --part or --requests-only on their "
                          "own[/red]")
            raise typer.Exit(2)
        raise typer.Exit(_verify_dataset(cfg))
    if part is not None and (repair or requests_only):
        console.print("[red]--part builds one part: --repair mends the whole dataset and --requests-only runs "
                      "before the parts; run them on their own[/red]")
        raise typer.Exit(2)
    _require(vllm=cfg.vllm)
    with _library_output(cfg):
        target = stages.prepare_target(cfg)
        if requests_only:
            console.print(f"data: {stages.write_requests(cfg, target, force=force)} prompts to build from")
            return
        if part is not None:
            print_result(stages.generate_data_part(cfg, target, part, force=force, config_hint=str(config)))
            return
        info = stages.generate_data(cfg, target, force=force, repair=repair, config_hint=str(config))
    print_result(info)


def _verify_dataset(cfg) -> int:
    """``peagle data --verify``: every shard hashed and reported; 0 when the dataset is sound."""
    from peagle.data.check import corrupt_store_message, stored_split_dirs, verify_store
    from peagle.data.store import format_bytes

    data = RunLayout(cfg.run_dir).data
    if not stored_split_dirs(data):
        console.print(f"[red]no dataset in {data.root}: build it first (`peagle data CONFIG`)[/red]", soft_wrap=True)
        return 2
    checks = verify_store(data, full=True)
    table = Table(title=f"Shards of {data.root}")
    for column in ("split", "shard", "samples", "size", "status"):
        table.add_column(column, justify="right" if column in ("samples", "size") else "left")
    for c in checks:
        status = "[green]ok[/green]" if c.ok else f"[red]corrupt: {c.problem}[/red]"
        table.add_row(c.split_dir.name, c.file, str(c.samples), format_bytes(c.bytes), status)
    console.print(table)
    bad = [c for c in checks if not c.ok]
    if bad:
        console.print(f"[red]{corrupt_store_message(data, bad)}[/red]", soft_wrap=True)
        return 1
    console.print(f"[green]{len(checks)} shard(s) sound[/green]")
    return 0


@app.command("train")
def train_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    method: str = typer.Option(None, help="A drafting method (peagle, eagle3); default train.method"),
):
    """Train the drafter with DeepSpeed on the run's dataset (resumes from its last checkpoint)."""
    cfg = _load(config, set_ or [])
    method = _method(method, cfg)
    _require(tracking=cfg.tracking if cfg.train.init_from == INIT_FROM_CHAMPION else None)
    try:  # no dataset, an unfinished or a corrupt one, a baseline timed by an untrained head: say so now
        plan = stages.plan_head(cfg, method, RunLayout(cfg.run_dir).data.root)
    except FileNotFoundError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    with _library_output(cfg):
        result = stages.train_head(plan, stages.prepare_target(cfg))
    print_result(result)


@app.command("produce")
def produce_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    method: str = typer.Option(None, help="Whose training to extract for (peagle, eagle3); default train.method"),
):
    """Extract a streamed dataset's hidden states for `peagle train` running on other hosts
    (data.producer: separate): this host's vLLM engines write them into the head's spool, in the
    order the ranks read them, until the training ends. Run it with the same config and --set as
    the training, on a host that sees the same run directory."""
    cfg = _load(config, set_ or [])
    method = _method(method, cfg)
    try:
        stages.require_separate_producer(cfg)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    _require(vllm=cfg.vllm)
    try:
        plan = stages.plan_head(cfg, method, RunLayout(cfg.run_dir).data.root)
    except FileNotFoundError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    with _library_output(cfg):
        finished = stages.produce_hidden_states(plan, stages.prepare_target(cfg))
    if not finished:
        console.print(f"[red]the training of {plan.method} in {plan.checkpoint_dir} failed or was stopped: rerun "
                      "`peagle train` and this command (both resume from its last checkpoint)[/red]", soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"[green]produced the hidden states of {plan.method}'s training in {plan.checkpoint_dir}[/green]")


@app.command("export")
def export_cmd(
    config: Path = ConfigArg,
    set_: list[str] = SetOpt,
    method: str = typer.Option(None, help="Which trained head to export (peagle, eagle3); default train.method"),
    checkpoint: Path = typer.Option(None, help="A step dir or a latest/best pointer (default: the best by offline "
                                    "acceptance of the head trained on this config and dataset)"),
    vllm_check: bool = typer.Option(True, help="Also load the head in vLLM and draft before publishing"),
):
    """Export a checkpoint as a head directory vLLM serves; refuses a head that fails validation."""
    from peagle.export.head import ExportError
    from peagle.export.validate import validate_head

    cfg = _load(config, set_ or [])
    method = _method(method, cfg)
    _require(vllm=_one_engine(cfg) if vllm_check else None)
    data_dir = RunLayout(cfg.run_dir).data.root
    with _library_output(cfg):
        target = stages.prepare_target(cfg)
        try:
            ckpt = checkpoint or stages.trained_checkpoint(cfg, method, data_dir)
            head = stages.export_head(cfg, target, data_dir, ckpt, method=method)
        except (ExportError, FileNotFoundError) as err:
            error = err
        else:
            error = None
            if vllm_check:
                validate_head(head, target.path, vllm_cfg=cfg.vllm, method=method)
    if error is not None:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2)
    console.print(f"head: {head}")


@app.command("evaluate")
def evaluate_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Acceptance per K and tokens/s in vLLM for the run's exported heads, against the baseline."""
    cfg = _load(config, set_)
    _require(vllm=_one_engine(cfg))
    run = RunLayout(cfg.run_dir)
    heads = {m: stages.exported_head_dir(cfg, m) for m in available_methods()
             if (stages.exported_head_dir(cfg, m) / CONFIG_FILE).exists()}
    if not heads:
        console.print(f"[red]no exported head under {run.heads}: run `peagle export` first[/red]")
        raise typer.Exit(2)
    with _library_output(cfg):
        online = stages.evaluate_online(cfg, stages.prepare_target(cfg), heads)
    print_online(online)
    from peagle.eval.plots import plot_online

    run.eval.mkdir(parents=True, exist_ok=True)
    console.print(f"plot: {plot_online(online, run.online_plot)}")
    console.print(f"table: {online.save(run.online_results)}")


@app.command("run")
def run_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt):
    """Run the whole pipeline as a Prefect flow and print acceptance per K."""
    cfg = _load(config, set_)  # fail on a bad config before Prefect starts

    stages.check_training_runs_here(cfg)  # and on a machine that cannot train it (main() says why, exit 2)
    _require(vllm=cfg.vllm, tracking=cfg.tracking, prefect=True)  # and without a service it needs
    from flows.pipeline import pipeline_flow

    result = pipeline_flow(config_path=str(config), overrides=parse_overrides(set_))
    print_summary(result)
    del cfg


@app.command("pull")
def pull_cmd(
    model_uri: str = typer.Argument(..., help="models:/<name>@<alias> (e.g. @champion) or models:/<name>/<version>"),
    out_dir: Path = typer.Argument(..., help="Where the head goes (must be empty or absent)"),
    target: str = typer.Option(None, help="The target's hub id or local path for the card's serve line "
                                          "(default: the hub id recorded with the version)"),
    tracking_uri: str = typer.Option(None, help="MLflow tracking server (default: MLFLOW_TRACKING_URI, else the local store)"),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT_DIR"),
):
    """Download a registered head, verified against its registered file hashes, ready to serve."""
    from peagle.publish.pull import pull_head
    from peagle.tracking.mlflow_run import read_client, resolve_tracking_uri

    try:
        client = read_client(resolve_tracking_uri(TrackingConfig(tracking_uri=tracking_uri)))
        pulled = pull_head(client, model_uri, out_dir, target=target, overwrite=overwrite)
    except (ValueError, LookupError, FileExistsError) as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(f"pulled {pulled.name} version {pulled.version} into {pulled.path}", soft_wrap=True)
    console.print(f"serve it: peagle serve {pulled.path}", soft_wrap=True)
    if pulled.serve_line:
        console.print(f"or:       {pulled.serve_line}", soft_wrap=True)


@app.command("push")
def push_cmd(
    head_dir: Path = typer.Argument(..., help="An exported head directory (`peagle export` writes <run>/heads/<method>)"),
    repo_id: str = typer.Argument(..., help="The Hub model repository, e.g. my-org/smollm2-135m-p-eagle (created "
                                            "if missing)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="List each file, its size and the repository; upload "
                                                          "nothing (needs no network)"),
    private: bool = typer.Option(False, "--private", help="Create the repository private (an existing one keeps "
                                                          "its visibility)"),
    revision: str = typer.Option(None, "--revision", help="The branch to upload to (created if missing; default "
                                                          "the repository's main)"),
):
    """Upload a head directory to the Hugging Face Hub, checked first; the token is HF_TOKEN or `hf auth login`'s."""
    from peagle.data.store import format_bytes
    from peagle.export.hub import PushError, UploadError, plan_upload, push_head

    try:
        upload = plan_upload(head_dir, repo_id)
        for warning in upload.warnings:
            console.print(f"[yellow]warning: {warning}[/yellow]", soft_wrap=True)
        where = upload.url + (f" (branch {revision})" if revision else "")
        if dry_run:
            console.print(f"would upload {len(upload.files)} files ({format_bytes(upload.total_bytes)}) of "
                          f"{upload.head_dir} to {where}:", soft_wrap=True)
            for name, size in upload.files.items():
                console.print(f"  {name}  {format_bytes(size)}", soft_wrap=True, highlight=False)
            console.print(f"its README.md's serve line names {repo_id}; nothing was uploaded (--dry-run)", soft_wrap=True)
            return
        url = push_head(upload, private=private, revision=revision)
    except PushError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    except UploadError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(f"pushed {len(upload.files)} files to {where}: {url}", soft_wrap=True)


@app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_cmd(
    ctx: typer.Context,
    head_dir: Path = typer.Argument(..., help="A head directory (e.g. from `peagle pull`)"),
    target: str = typer.Option(None, help="The target's hub id or local path (default: the head card's)"),
    k: int = typer.Option(None, "-K", "--num-speculative-tokens", help="Draft tokens per step (default: the card's)"),
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: int = typer.Option(8000, help="Port of the OpenAI-compatible API"),
    served_model_name: str = typer.Option(None, help="The model name clients ask for (default: the card's, "
                                                     "the head's registered name when pulled)"),
):
    """Start `vllm serve` for the target with this head drafting; arguments after `--` go to vLLM."""
    from peagle.export.serving_plan import plan_serving
    from peagle.serving.server import ServerStartError, VllmServer, api_server_argv

    _require(vllm=VllmConfig())  # vLLM and one device to serve on
    try:
        serving = plan_serving(head_dir, target=target, k=k, served_name=served_model_name)
    except ValueError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    server = VllmServer(api_server_argv(serving, host=host, port=port, extra_args=ctx.args), host=host, port=port)
    mode = "in parallel (P-EAGLE)" if serving.parallel_drafting else "one token per pass (EAGLE-3)"
    console.print(f"vllm serve {serving.target}: {serving.head_dir} drafts K={serving.k} {mode}", soft_wrap=True)
    try:
        status = server.run(lambda: console.print(f"ready: {server.url}/v1 (OpenAI API), metrics at "
                                                  f"{server.url}/metrics", soft_wrap=True))
    except ServerStartError as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    raise typer.Exit(status)


@app.command("deploy")
def deploy_cmd(
    prefect_file: Path = typer.Option(None, help="The Prefect deployments file (default: the checkout's prefect.yaml)"),
    name: list[str] = typer.Option(None, "--name", help="Only these deployments (repeatable); default: all"),
    check: bool = typer.Option(False, "--check", help="Only check the deployments (flows, parameters, configs, "
                                                      "GPUs vs train.launch.world_size); deploy nothing"),
):
    """Check prefect.yaml, create its missing work pools, then `prefect deploy` it (Prefect's own CLI)."""
    from flows.deploy import PREFECT_FILE, DeployError, check_deployments, deploy

    prefect_file = prefect_file or PREFECT_FILE
    try:
        results = check_deployments(prefect_file, name or None)
        for r in results:
            console.print(f"[green]ok[/green] {r.message}" if r.ok else f"[red]refused[/red] {r.message}",
                          soft_wrap=True)
        refused = [r.deployment for r in results if not r.ok]
        if refused:
            console.print(f"[red]{prefect_file}: {len(refused)} deployment(s) refused: {', '.join(refused)}[/red]",
                          soft_wrap=True)
            raise typer.Exit(1)
        if not check:
            created = deploy(prefect_file, name or None)
            console.print(f"deployed {len(results)} deployments from {prefect_file}"
                          + (f" (work pools created: {', '.join(created)})" if created else ""), soft_wrap=True)
    except (DeployError, ConfigError) as err:
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("retrain")
def retrain_cmd(config: Path = ConfigArg, set_: list[str] = SetOpt,
                force: bool = typer.Option(False, help="Retrain even when nothing changed"),
                warm_start: bool = typer.Option(False, help="Start from the champion's weights (train.init_from)")):
    """Retrain only if the prompts, target or config changed since the champion; promote if better."""
    cfg = _load(config, set_)
    _require(vllm=cfg.vllm, tracking=cfg.tracking, prefect=True)
    from flows.retrain import retrain_flow

    result = retrain_flow(config_path=str(config), overrides=parse_overrides(set_), force=force,
                          warm_start=warm_start)
    console.print(result.message)
    if result.pipeline is not None:
        print_summary(result.pipeline)


def print_online(online) -> None:
    """One table per prompt set: tokens per target step, vLLM's acceptance length and output
    tokens/s in vLLM, against no speculation and n-gram lookup."""
    for measured in online.prompt_sets():
        traffic = "completion traffic, no chat template" if measured is online.completion else "chat"
        console.print(measured.to_table(title=f"Tokens per target step and output tokens/s in vLLM: "
                                              f"{measured.prompt_set} ({traffic})"))


def print_summary(result) -> None:
    print_online(result.online)
    offline = result.offline.acceptance_length
    where = "eval prompts, decoded as vLLM does" if getattr(result.offline, "split", "") == "served" else "held-out"
    console.print(f"offline acceptance ({where}): " + ", ".join(f"K={k}: {v:.2f}" for k, v in offline.items()))
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
    configure_environment()  # once, before any library the commands import reads its settings
    mark_absent("sklearn")  # transformers would import it with any model class; no command uses it
    record_interrupts()

    show_on_console()  # peagle's own progress lines; libraries' output goes to the run's log file

    try:
        app()
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        sys.exit(2)
    except (DiskSpaceError, CorruptShardError) as err:  # the message names the disk or shard and the fix
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        sys.exit(1)
    except EngineStartError as err:  # a device, memory or replica problem: the message says what to do
        console.print(f"[red]{err}[/red]")
        sys.exit(1)
    except ServiceUnavailable as err:  # one line: the service, what is wrong, how to start or point at one
        console.print(f"[red]{err}[/red]", soft_wrap=True)
        sys.exit(EXIT_UNAVAILABLE)
    except SystemExit as done:
        if done.code == INTERRUPTED:
            exit_now(INTERRUPTED)
        raise
    except Exception:
        if interrupted():  # an engine that died of the same Ctrl-C: the interruption, not a fault
            console.print("[yellow]interrupted[/yellow]")
            exit_now(INTERRUPTED)
        raise


INTERRUPTED = 130  # typer's exit code for a Ctrl-C


def exit_now(code: int) -> None:
    """Leave at once after a Ctrl-C: every stage has made what it keeps durable by then, and the
    interpreter's own shutdown (a last garbage collection of torch's and vLLM's heap) takes seconds."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
