"""Start drafter training in its own process group: torchrun on one host, DeepSpeed's launcher across hosts.

Entry point (what every rank runs)::

    python -m peagle.train.launch --config configs/demo.yaml [--set train.epochs=3] \\
        --data-dir RUN/data --target TARGET_DIR --out RUN/checkpoints/peagle
    python -m peagle.train.launch --config-json '{"name": ..., ...}' ...   # or a .json path

``launch_training`` runs it as a subprocess and waits:

- ``train.world_size == 1``: ``python -m torch.distributed.run --standalone --nproc_per_node=1 -m peagle.train.launch ...``
- ``train.world_size == N`` on this host: the same with ``--nproc_per_node=N`` (one process
  per GPU; on CPU N gloo processes).
- several hosts: pass ``hostfile`` (DeepSpeed format, one ``HOST slots=GPUS`` line per
  host, every host reachable by passwordless ssh/pdsh, same paths and Python env, and
  ``out_dir`` on a filesystem all hosts share). It runs::

      deepspeed --hostfile HOSTFILE --master_addr FIRST_HOST --module peagle.train.launch \\
          --config-json OUT/launch_config.json --data-dir ... --target ... --out ...

  with ``train.world_size`` = total slots. The launcher exports, per process, ``RANK``
  (global: picks the data shard; rank 0 writes checkpoints and metrics), ``LOCAL_RANK``
  (on its host: picks the GPU), ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
  ``engine.init_process_group`` reads exactly those.

The child's output is streamed through; a non-zero exit raises ``TrainingFailed`` with
its last lines. Rank 0 writes ``train_result.json``, which becomes the returned
``TrainResult``.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from peagle.config import ConfigError, PipelineConfig, load_config, parse_config, parse_overrides
from peagle.fileio import write_text_atomic
from peagle.layout import LAUNCH_CONFIG_FILE
from peagle.train.trainer import RESULT_FILE, TrainResult

LAUNCH_CONFIG = LAUNCH_CONFIG_FILE
TAIL_LINES = 40
DIST_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT"}


class TrainingFailed(RuntimeError):
    """The training processes exited with an error; the message carries their last output."""


# ----------------------------------------------------------------------------- parent side


def training_command(
    cfg_json: Path, data_dir: Path, target_path: str, out_dir: Path, world_size: int,
    hostfile: Path | None = None, eval_factory: str | None = None, progress: bool = True,
) -> list[str]:
    """The launcher command line (see the module docstring for which launcher when)."""
    args = ["--config-json", str(cfg_json), "--data-dir", str(data_dir), "--target", str(target_path), "--out", str(out_dir)]
    if eval_factory:
        args += ["--eval-factory", eval_factory]
    if not progress:
        args.append("--no-progress")
    if hostfile is not None:
        first_host = next(
            line.split()[0] for line in Path(hostfile).read_text().splitlines() if line.strip() and not line.startswith("#")
        )
        return ["deepspeed", "--hostfile", str(hostfile), "--master_addr", first_host, "--module", "peagle.train.launch", *args]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
        "-m", "peagle.train.launch", *args,
    ]


def launch_training(
    cfg: PipelineConfig,
    data_dir: Path,
    target_path: str,
    out_dir: Path,
    *,
    hostfile: Path | None = None,
    eval_factory: str | None = None,
    progress: bool = True,
    env: dict[str, str] | None = None,
) -> TrainResult:
    """Train in ``train.world_size`` fresh processes and return rank 0's ``TrainResult``.

    ``eval_factory`` ("module:function") names ``function(cfg, data_dir, target_path) ->
    eval_fn`` that every rank calls to build the offline-acceptance hook (the callable
    itself cannot cross the process boundary).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_json = out_dir / LAUNCH_CONFIG
    write_text_atomic(cfg_json, cfg.model_dump_json(by_alias=True, indent=1))
    (out_dir / RESULT_FILE).unlink(missing_ok=True)
    cmd = training_command(
        cfg_json, Path(data_dir), target_path, out_dir, cfg.train.world_size, hostfile, eval_factory, progress
    )
    # A caller that is itself a rank (tests, notebooks) must not leak its rendezvous to the children.
    child_env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    child_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    run_streaming(cmd, child_env)
    result_path = out_dir / RESULT_FILE
    if not result_path.exists():
        raise TrainingFailed(f"training exited cleanly but wrote no {result_path}")
    return TrainResult.from_json(result_path.read_text())


def run_streaming(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` echoing its output line by line; a non-zero exit raises ``TrainingFailed``."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    except FileNotFoundError as err:
        raise TrainingFailed(f"cannot start the launcher ({err}); is DeepSpeed installed in this environment?") from None
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        raise TrainingFailed(
            f"training exited with code {code}\ncommand: {' '.join(cmd)}\nlast output:\n" + "\n".join(tail)
        )


# ----------------------------------------------------------------------------- child side


def _load_cfg(args) -> PipelineConfig:
    if args.config:
        return load_config(args.config, parse_overrides(args.set))
    text = args.config_json
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--config-json {text!r}: neither inline JSON nor an existing file")
        text = path.read_text()
    return parse_config(json.loads(text), "--config-json")


def _eval_fn(factory: str | None, cfg: PipelineConfig, data_dir: Path, target_path: str):
    if not factory:
        return None
    module, sep, name = factory.partition(":")
    if not sep:
        raise ValueError(f"--eval-factory {factory!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), name)(cfg, data_dir, target_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peagle.train.launch", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="pipeline config YAML")
    source.add_argument("--config-json", help="the pipeline config as JSON (inline, or a .json file)")
    parser.add_argument("--set", action="append", help="override a key of --config: train.epochs=3")
    parser.add_argument("--data-dir", required=True, type=Path, help="dataset directory (target_facts.json, splits/, vocab)")
    parser.add_argument("--target", required=True, help="the target model's local directory")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint/metrics directory (resumed if it has one)")
    parser.add_argument("--eval-factory", help="module:function returning eval_fn(drafter) -> acceptance")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment is what is used.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from peagle.paths import configure_environment

    configure_environment()
    try:
        cfg = _load_cfg(args)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    from peagle.train.trainer import train_drafter

    train_drafter(
        cfg,
        args.data_dir,
        args.target,
        args.out,
        progress=not args.no_progress,
        eval_fn=_eval_fn(args.eval_factory, cfg, args.data_dir, args.target),
        resume=not args.no_resume,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
