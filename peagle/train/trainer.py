"""The training loop: DeepSpeed steps over the shard store, checkpoints, metrics, best-by-acceptance.

``train_drafter`` runs in every rank of the current process group (one process, or each
process that ``torchrun`` / the ``deepspeed`` launcher started; see ``launch``). Per
optimizer step each rank consumes ``grad_accum`` micro-batches of its own slice of the
epoch's seeded order; each micro-batch runs as ``train.recipe.segments`` forward+backward
passes (sequence partitioning) whose losses are divided by the micro-batch's whole
supervised count. DeepSpeed reduces, clips and steps once per optimizer step.

Outputs under ``out_dir``: ``step-NNNNNN/`` checkpoints (``checkpoint``), ``latest`` /
``best`` pointers, ``metrics.jsonl`` (one JSON object per step and per evaluation,
written by rank 0, each with its wall-clock ``time``) and ``train_result.json``. A rerun with the same ``out_dir`` resumes
from ``latest`` at the exact data position, optimizer, schedule and RNG state, if it trains
the same head (``peagle.identity.head_identity``, kept in each checkpoint's
``trainer_state.json`` as ``head_identity``); bookkeeping such as ``keep_last`` may change,
and so may the world size when ``world_size x grad_accum`` stays (``checkpoint``).
Each step's record lists the split's samples it trained on (``samples``, over all ranks).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from peagle.checkpoint_format import TrainerState, best_checkpoint, check_same_head, latest_checkpoint, read_trainer_state
from peagle.config import INIT_FROM_CHAMPION, PipelineConfig, TrainConfig
from peagle.facts import HeadSpec, head_spec_for, load_dataset_facts
from peagle.fileio import write_text_atomic
from peagle.identity import dataset_manifests, head_identity
from peagle.layout import METRICS_FILE, TRAIN_SPLIT, DataLayout, spool_dir
from peagle.layout import TRAIN_RESULT_FILE as RESULT_FILE
from peagle.methods import get_method
from peagle.objective import Objective
from peagle.train import checkpoint as ckpt
from peagle.train.budget import FIRST_IN_PROCESS, TrainingClock
from peagle.train.data import BatchPlan, EpochSamples, epoch_loader, training_samples
from peagle.train.engine import DistInfo, build_engine, current_lr, init_process_group, micro_steps_per_step, use_gpu

STAT_KEYS = ("kl_sum", "correct", "count")

EvalFn = Callable[[torch.nn.Module], float]
MetricsCallback = Callable[[int, dict], None]


@dataclass
class TrainResult:
    last_checkpoint: Path | None
    best_checkpoint: Path | None  # highest offline acceptance; None when nothing was evaluated
    metrics_history: list[dict] = field(default_factory=list)
    warm_start: dict | None = None  # train.init_from: what was loaded (peagle.train.warm_start)

    def to_json(self) -> str:
        data = asdict(self)
        data["last_checkpoint"] = str(self.last_checkpoint) if self.last_checkpoint else None
        data["best_checkpoint"] = str(self.best_checkpoint) if self.best_checkpoint else None
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainResult:
        data = json.loads(text)
        return cls(
            last_checkpoint=Path(data["last_checkpoint"]) if data["last_checkpoint"] else None,
            best_checkpoint=Path(data["best_checkpoint"]) if data["best_checkpoint"] else None,
            metrics_history=data["metrics_history"],
            warm_start=data.get("warm_start"),
        )


# ----------------------------------------------------------------------------- objective


def make_objective(train: TrainConfig, spec: HeadSpec, target_head) -> Objective:
    """What ``train.method`` trains (its method object's objective)."""
    return get_method(train.method).objective(train, spec, target_head)


def build_drafter(train: TrainConfig, inputs: TrainingInputs, target_path: str):
    """The drafter a run of ``train`` starts from, before any warm start or DeepSpeed: the
    target's rows where it is as wide, seeded by ``train.recipe.seed``, with the method's trainable
    set and its own initialisation (``DraftingMethod.prepare_drafter``)."""
    from peagle.model import PEagleDrafter, check_attention_backend

    check_attention_backend(train.launch.attention, torch.device("cuda" if use_gpu() else "cpu"))
    torch.manual_seed(train.recipe.seed)
    drafter = PEagleDrafter.from_target(inputs.spec, target_path, inputs.draft_ids)
    get_method(train.method).prepare_drafter(drafter, train)
    drafter.attention = train.launch.attention
    return drafter


# ----------------------------------------------------------------------------- inputs


@dataclass
class TrainingInputs:
    spec: HeadSpec  # the head being trained: saved in every checkpoint
    samples: Any  # a ShardReader (or any sequence of samples)
    draft_ids: torch.Tensor
    streamed: bool = False  # samples hold tokens only; hidden states come from the spool (peagle.data.spool)


def load_training_inputs(data_dir: Path, cfg: PipelineConfig) -> TrainingInputs:
    """The head ``cfg`` trains on a dataset directory: its spec (the dataset's target facts +
    ``cfg.drafter``'s shape + the method), training split and draft vocabulary, checked first."""
    from peagle.data.spool import is_streamed
    from peagle.data.store import ShardReader
    from peagle.data.vocab import DraftVocab

    data = DataLayout(data_dir)
    facts = load_dataset_facts(data)
    for need in (data.vocab, data.manifest(TRAIN_SPLIT)):
        if not need.exists():
            raise FileNotFoundError(f"{need} not found: build the dataset first (`peagle data CONFIG`)")
    vocab = DraftVocab.load(data.vocab)
    if facts.draft_vocab_size != vocab.size:
        raise ValueError(
            f"{data.root}: {data.facts.name} says draft_vocab_size={facts.draft_vocab_size} but "
            f"{data.vocab.name} has {vocab.size} ids; the dataset is inconsistent, rebuild it"
        )
    samples = training_samples(ShardReader(data.train), cfg.train.recipe.max_samples)
    return TrainingInputs(spec=head_spec_for(cfg, facts), samples=samples, draft_ids=vocab.draft_ids,
                          streamed=is_streamed(data.train))


# ----------------------------------------------------------------------------- metrics


class MetricsLog:
    """``metrics.jsonl`` on rank 0: one object per line, flushed as written."""

    def __init__(self, path: Path, enabled: bool, on_metrics: MetricsCallback | None):
        self.path, self.enabled, self.on_metrics = path, enabled, on_metrics
        self.history: list[dict] = []

    def resume_at(self, step: int) -> None:
        """Drop records after ``step`` (a killed run logged steps its checkpoint does not hold)."""
        if not self.path.exists():
            return
        kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        self.history = [r for r in kept if r["step"] <= step]
        if self.enabled:
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.history))

    def write(self, record: dict) -> None:
        """Append ``record`` stamped with rank 0's wall clock (``time``, Unix seconds): the
        timestamp trackers give the step, however late they read it."""
        record = {**record, "time": time.time()}
        self.history.append(record)
        if self.enabled:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self.on_metrics is not None:
                self.on_metrics(record["step"], record)


class StepStats:
    """Sums over one optimizer step's micro-batches (and segments), reduced across ranks."""

    def __init__(self, k: int, device: torch.device):
        self.k, self.device = k, device
        self.depth = torch.zeros(len(STAT_KEYS), k, dtype=torch.float64)
        self.loss = 0.0  # sum over micro-batches of the optimized loss
        self.micro_batches = 0
        self.tokens = 0
        self.samples: list[int] = []  # indices into the split this rank trained on in the step

    def add_segment(self, out) -> None:
        self.loss += float(out.loss.detach())
        for i, key in enumerate(STAT_KEYS):
            values = out.depth_stats.get(key) if out.depth_stats else None
            if values is not None:
                self.depth[i, : values.numel()] += values.detach().double().cpu()[: self.k]

    def reduced(self) -> dict:
        """Loss (mean over micro-batches and ranks), per-depth loss/acc and tokens, all ranks."""
        totals = torch.tensor([self.loss, self.micro_batches, self.tokens], dtype=torch.float64)
        flat = torch.cat([self.depth.reshape(-1), totals])
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = flat.to(self.device)
            dist.all_reduce(flat)
            flat = flat.cpu()
        depth = flat[: self.depth.numel()].reshape(self.depth.shape)
        loss_sum, micro, tokens = flat[self.depth.numel() :].tolist()
        from peagle.objective.loss import metrics_from_stats

        record = {"loss": loss_sum / max(micro, 1), "tokens": int(tokens), "samples": self.all_samples()}
        record.update(metrics_from_stats({key: depth[i] for i, key in enumerate(STAT_KEYS)}))
        return record

    def all_samples(self) -> list[int]:
        """The split's samples every rank trained on in this step, sorted: the data order, auditable
        (every rank consumes the same number per step, so a plain all-gather collects them)."""
        mine = torch.tensor(self.samples, dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.empty_like(mine, device=self.device) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine.to(self.device))
            mine = torch.cat([t.cpu() for t in gathered])
        return sorted(mine.tolist())


# ----------------------------------------------------------------------------- one step


def run_micro_batch(engine, objective: Objective, examples: list, segments: int, grad_accum: int, stats: StepStats) -> None:
    """Forward+backward of one micro-batch (a list of examples), ``segments`` DeepSpeed micro-steps long.

    Each segment's loss is already divided by the whole micro-batch's normaliser (the
    objective's ``denominator``), so the segments' gradients sum to the unpartitioned
    gradient; dividing by ``grad_accum`` here (not by DeepSpeed, which counts segments
    too) averages micro-batches. DeepSpeed steps only at its accumulation boundary, which
    falls after the last segment of the last micro-batch.
    """
    denominator = objective.denominator(examples)
    ran = 0
    for part in objective.batches(examples, segments):
        out = objective.loss(engine, part.to(engine.device), denominator)
        engine.backward(out.loss / grad_accum, scale_wrt_gas=False)
        engine.step()
        stats.add_segment(out)
        ran += 1
        del out, part
    if ran != segments:
        raise RuntimeError(f"sequence partitioning ran {ran} segments, expected train.recipe.segments={segments}")
    stats.micro_batches += 1


# ----------------------------------------------------------------------------- evaluation


def evaluate(engine, spec: HeadSpec, eval_fn: EvalFn | None, dist_info: DistInfo, state_dict) -> float | None:
    """Offline acceptance of the current weights (rank 0 runs ``eval_fn``; all ranks get it)."""
    if eval_fn is None:
        return None
    value = torch.zeros(1, dtype=torch.float64)
    if dist_info.is_main:
        from peagle.model import PEagleDrafter

        drafter = PEagleDrafter(spec)
        drafter.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
        drafter.eval()
        with torch.no_grad():
            value[0] = float(eval_fn(drafter))
    if dist.is_initialized() and dist_info.world_size > 1:
        value = value.to(engine.device)
        dist.broadcast(value, src=0)
    return float(value.cpu()[0])


def check_replicas(engine, dist_info: DistInfo) -> list[float]:
    """Every rank's parameter fingerprint; data-parallel replicas must be identical."""
    mine = torch.tensor([ckpt.replica_checksum(engine)], dtype=torch.float64)
    if dist_info.world_size == 1:
        return mine.tolist()
    gathered = [torch.zeros(1, dtype=torch.float64, device=engine.device) for _ in range(dist_info.world_size)]
    dist.all_gather(gathered, mine.to(engine.device))
    values = [float(t.cpu()[0]) for t in gathered]
    if len(set(values)) != 1:
        raise RuntimeError(f"data-parallel replicas diverged: parameter fingerprints per rank {values}")
    return values


# ----------------------------------------------------------------------------- the loop


def train_drafter(
    cfg: PipelineConfig,
    data_dir: Path,
    target_path: str,
    out_dir: Path,
    *,
    progress: bool = True,
    eval_fn: EvalFn | None = None,
    on_metrics: MetricsCallback | None = None,
    resume: bool = True,
    inputs: TrainingInputs | None = None,
    identity: str | None = None,
) -> TrainResult:
    """Train (or resume training) a drafter in the current process group; see the module doc.

    ``eval_fn(drafter) -> acceptance`` (run on rank 0 at ``train.checkpoints.eval_every`` steps and at
    the end) picks the best checkpoint; ``on_metrics(step, record)`` sees every record
    written to ``metrics.jsonl``. ``inputs`` overrides what is read from ``data_dir``.
    ``identity`` is the head's (``peagle.identity``), which a resumed checkpoint must hold: the
    launcher's, else worked out here.
    With ``train.recipe.max_steps`` set, training runs that many optimizer steps (as many epochs
    as needed); with ``train.recipe.max_train_seconds``, until its steps have taken that long
    (``peagle.train.budget``); otherwise ``train.recipe.epochs`` whole epochs.
    """
    from peagle.model import target_config
    from peagle.objective.loss import TargetHead

    train = cfg.train
    out_dir = Path(out_dir)
    if train.init_from == INIT_FROM_CHAMPION:
        raise ValueError(
            "train.init_from 'champion' is resolved by the pipeline (peagle run / the train flow), which "
            "downloads the registry champion first; here give an exported head directory"
        )
    inputs = inputs or load_training_inputs(data_dir, cfg)
    target_config(target_path)  # a missing target fails here, before DeepSpeed starts
    spec = inputs.spec
    resumable = latest_checkpoint(out_dir) if resume else None
    if resumable is not None:  # checkpoints of another head (e.g. drafter.num_layers changed): say so before any work
        check_same_head(resumable, spec)
    dist_info = init_process_group()
    if dist_info.world_size != train.launch.world_size:
        raise ValueError(
            f"train.launch.world_size={train.launch.world_size} but this process group has {dist_info.world_size} ranks; "
            "start training with peagle.train.launch.launch_training (it runs torchrun with the right size)"
        )
    if inputs.streamed:
        from peagle.data.spool import SpooledSamples

        start_step = read_trainer_state(resumable).step if resumable is not None else 0
        inputs = replace(inputs, samples=SpooledSamples(inputs.samples, spool_dir(out_dir), dist_info.rank,
                                                        start_step=start_step), streamed=False)
    plan = BatchPlan(len(inputs.samples), dist_info.world_size, train.recipe.micro_batch_size, train.grad_accum)
    plan.check()
    # A time budget stops the loop by the clock (at most max_steps); total_steps 0 then means "no step count".
    total_steps = train.recipe.max_steps or (0 if train.recipe.max_train_seconds else plan.steps_per_epoch * train.recipe.epochs)
    clock = TrainingClock(train.recipe.max_train_seconds) if train.recipe.max_train_seconds else None

    drafter = build_drafter(train, inputs, target_path)  # what trains: before DeepSpeed sees it
    warm = None
    if train.init_from:  # a resumed run then loads its checkpoint over these weights
        from peagle.train.warm_start import warm_start

        warm = asdict(warm_start(drafter, train.init_from, inputs.draft_ids))
        if dist_info.is_main:
            fresh = (f"; not in the head, kept as initialised: {', '.join(warm['kept_fresh'])}"
                     if warm["kept_fresh"] else "")
            tqdm.write(f"warm start from {warm['head_dir']}: {warm['lm_head_rows_copied']} lm_head rows kept, "
                       f"{warm['lm_head_rows_new']} new draft tokens from the target{fresh}")
    engine = build_engine(drafter, train, total_steps, dist_info.world_size, clock)
    engine.train()
    target_head = TargetHead.from_target(target_path, spec, inputs.draft_ids).to(engine.device)
    objective = make_objective(train, spec, target_head)
    dataset = EpochSamples(inputs.samples, objective.make_example, train.recipe.seed)

    if dist_info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out_dir / METRICS_FILE, dist_info.is_main, on_metrics)
    step = 0
    identity = identity or head_identity(cfg, dataset_manifests(data_dir))  # what a resumed run must share
    previous = latest_checkpoint(out_dir)
    if previous is not None and not resume:
        raise FileExistsError(
            f"{out_dir} already holds checkpoints (latest {previous.name}); resume from them or use a fresh output directory"
        )
    if previous is not None:
        state = ckpt.load_checkpoint(engine, previous)
        _check_resumable(state, plan, total_steps, identity, previous)
        step = state.step
        log.resume_at(step)
        if clock is not None:
            clock.restore(state.train_seconds, step, state.counted_steps)
    elif dist_info.is_main and (out_dir / METRICS_FILE).exists():
        (out_dir / METRICS_FILE).unlink()
    if dist.is_initialized():
        dist.barrier()

    def state_at(step: int, acceptance: float | None, record: dict, checksums: list[float]) -> TrainerState:
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        return TrainerState(
            step=step,
            epoch=epoch,
            epoch_position=in_epoch * plan.grad_accum,
            world_size=dist_info.world_size,
            steps_per_epoch=plan.steps_per_epoch,
            micro_batch_size=plan.micro_batch_size,
            grad_accum=plan.grad_accum,
            total_steps=total_steps,
            zero_stage=train.launch.zero_stage,
            head_identity=identity,
            train_seconds=clock.elapsed_s if clock is not None else 0.0,
            counted_steps=clock.counted if clock is not None else None,
            acceptance=acceptance,
            metrics=record,
            replica_checksums=checksums,
        )

    def checkpoint_now(step: int, record: dict, evaluate_now: bool) -> None:
        state_dict = ckpt.gathered_state_dict(engine)
        acceptance = evaluate(engine, spec, eval_fn, dist_info, state_dict) if evaluate_now else None
        if acceptance is not None:
            log.write({"step": step, "eval/acceptance": acceptance})
        checksums = check_replicas(engine, dist_info)
        ckpt.save_checkpoint(
            engine, spec, state_at(step, acceptance, record, checksums), out_dir, train.checkpoints.keep_last, state_dict
        )

    bar = progress_bar(total_steps, step, clock, f"train {objective.name}", progress and dist_info.is_main)
    gas = micro_steps_per_step(train)
    def run_over(step: int) -> bool:
        """The step count reached, or the time budget spent: at the start (a finished run resumed) and after each step."""
        return bool(total_steps and step >= total_steps) or (clock is not None and clock.done())

    finished = run_over(step)
    first_in_process = True  # compiles and allocates: left off the clock (peagle.train.budget)
    while not finished:
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        batches = iter(epoch_loader(dataset, plan, epoch, dist_info.rank, list, in_epoch * plan.grad_accum))
        for _ in range(plan.steps_per_epoch - in_epoch):
            start = time.perf_counter()
            stats = StepStats(objective.depths, engine.device)
            for _ in range(plan.grad_accum):
                examples, tokens, indices = next(batches)
                stats.tokens += tokens
                stats.samples += indices
                run_micro_batch(engine, objective, examples, train.recipe.segments, train.grad_accum, stats)
            if engine.global_steps != step + 1 or engine.micro_steps % gas:
                raise RuntimeError(f"DeepSpeed is at step {engine.global_steps}, expected {step + 1}: accumulation is off")
            step += 1
            seconds = time.perf_counter() - start
            record = {"step": step, "epoch": epoch, "lr": current_lr(engine), **stats.reduced()}
            record["step_time_s"] = seconds
            record["tokens_per_s"] = record["tokens"] / seconds
            if first_in_process:
                record[FIRST_IN_PROCESS] = True
            if clock is not None:
                if first_in_process:
                    clock.skip()
                else:
                    clock.add(seconds, engine.device, dist_info.world_size)
                record["train_seconds"] = clock.elapsed_s
            first_in_process = False
            grad_norm = engine.get_global_grad_norm()
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            log.write(record)
            advance(bar, clock)
            bar.set_postfix(step=step, loss=f"{record['loss']:.4f}", acc=f"{record.get('acc', 0.0):.3f}")
            last = run_over(step)
            eval_due = bool(train.checkpoints.eval_every) and step % train.checkpoints.eval_every == 0
            evaluate_now = eval_fn is not None and (last or eval_due)
            if last or eval_due or _save_due(train, step, plan):
                checkpoint_now(step, record, evaluate_now)
            if last:
                finished = True
                break
    bar.close()

    result = TrainResult(
        last_checkpoint=latest_checkpoint(out_dir),
        best_checkpoint=best_checkpoint(out_dir),
        metrics_history=log.history,
        warm_start=warm,
    )
    if dist_info.is_main:
        write_text_atomic(out_dir / RESULT_FILE, result.to_json())
    return result


def progress_bar(total_steps: int, step: int, clock: TrainingClock | None, desc: str, show: bool):
    """Steps out of the step count; with a time budget, seconds out of the budget."""
    if clock is None:
        return tqdm(total=total_steps, initial=step, desc=desc, disable=not show)
    return tqdm(total=clock.budget_s, initial=clock.elapsed_s, desc=desc, unit="s", disable=not show,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]")


def advance(bar, clock: TrainingClock | None) -> None:
    """One step on a step bar; on a time bar, to the clock (a step it leaves out adds nothing).
    A last step may end past the budget: the total grows with it (tqdm would otherwise drop the
    total and fail to format the bar)."""
    if clock is None:
        bar.update(1)
        return
    bar.total = max(bar.total, clock.elapsed_s)
    bar.update(clock.elapsed_s - bar.n)


def _save_due(train: TrainConfig, step: int, plan: BatchPlan) -> bool:
    if train.checkpoints.save_every:
        return step % train.checkpoints.save_every == 0
    if train.checkpoints.eval_every:
        return False  # evaluation steps are the checkpoint cadence
    return step % plan.steps_per_epoch == 0  # neither set: once per epoch


def _check_resumable(state: TrainerState, plan: BatchPlan, total_steps: int, identity: str, where: Path) -> None:
    mismatch = {
        name: (old, new)
        for name, old, new in [
            ("head identity (dataset, weight-changing config, method)", state.head_identity, identity),
            ("steps per epoch", state.steps_per_epoch, plan.steps_per_epoch),
            ("micro batch size", state.micro_batch_size, plan.micro_batch_size),
            # world_size x grad_accum may split differently (peagle.train.checkpoint reshards)
            ("micro-batches per step (world_size x grad_accum)", state.world_size * state.grad_accum,
             plan.world_size * plan.grad_accum),
            ("total steps", state.total_steps, total_steps),
        ]
        if old != new
    }
    if mismatch:
        detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in mismatch.items())
        raise ValueError(
            f"cannot resume from {where}: it was trained with different settings ({detail}); "
            "use a fresh output directory (or restore the original config)"
        )
