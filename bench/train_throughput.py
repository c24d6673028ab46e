"""Training throughput against the closest peer trainer: our P-EAGLE step vs speculators' on the same shapes.

Both drafters are built for one dataset's target (the config's: the demo's real model by
default, ``--config configs/tiny.yaml`` for the tiny test target) with the same
shape (layers, heads, KV heads, head_dim, intermediate, draft vocabulary), the same COD
settings (k_train depths, ratio, floor) and the same samples in the same order, fp32 on
the CPU, each with its own recipe's trainable set and torch's AdamW, one sample per step
(the demo's micro-batch):

- peagle: ``build_peagle_example`` (COD sampling) + ``collate``, then ``peagle_loss`` (the
  attention mask, drafter forward, frozen target head, KL), backward, AdamW;
- speculators (``make bench-install`` adds ``speculators`` 0.9.0 without its
  dependencies): ``PEagleDraftModel.forward`` (its COD sampling, block mask, drafter, its
  verifier head and KL), backward, AdamW. On the CPU its trainer needs
  ``--draft-attn-impl sdpa`` (its default, flex attention, has no backward there),
  ``--loss-implementation eager`` (its fused loss is a Triton kernel) and
  compiles nothing (``torch.compile`` only with CUDA); so it runs here.

Each step is timed per phase, best of the repetitions per sample, after warm-up steps, the
two trainers taking turns sample by sample; tokens/s counts each sample's tokens once. A
last row times our real trainer (DeepSpeed engine, launcher process, data loading included)
on the same config: a fresh run of as many optimizer steps, in its own sample order, its
tokens/s.

    .venv/bin/python bench/train_throughput.py [--config CONFIG] [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from result_files import per_target_name  # noqa: E402
from train_common import Run, epochs_override, head_parser, setup_head_bench, target_info, tiny_head_dataset, train_fresh  # noqa: E402

NAME = "train_throughput"
PEER = "speculators"


def peer_available() -> str | None:
    """The peer's version, or None when it is not installed (``make bench-install`` adds it)."""
    try:
        from importlib.metadata import version

        import speculators.models.peagle  # noqa: F401
        from loguru import logger

        logger.disable("speculators")  # its per-file loading messages, not our table
        return version("speculators")
    except ImportError:
        return None


# ----------------------------------------------------------------------------- ours


class OurStep:
    """One optimizer step of the trainer's objective on one sample, outside DeepSpeed."""

    def __init__(self, cfg, target_path: str, inputs):
        from peagle.objective.loss import TargetHead
        from peagle.train.trainer import build_drafter, make_objective

        self.drafter = build_drafter(cfg.train, inputs, target_path)  # the trainer's own drafter and trainable set
        self.drafter.train()
        self.objective = make_objective(cfg.train, inputs.spec, TargetHead.from_target(target_path, inputs.spec,
                                                                                       inputs.draft_ids))
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.train.recipe.learning_rate)

    def __call__(self, sample, seed: int) -> tuple[dict, int]:
        times, t = {}, time.perf_counter()
        example = self.objective.make_example(sample, torch.Generator().manual_seed(seed))
        batch = self.objective.collate([example])  # the mask is evaluated inside the loss
        times["COD sampling"], t = time.perf_counter() - t, time.perf_counter()
        out = self.objective.loss(self.drafter, batch, self.objective.denominator([example]))
        times["forward + loss"], t = time.perf_counter() - t, time.perf_counter()
        out.loss.backward()
        times["backward"], t = time.perf_counter() - t, time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["optimizer"] = time.perf_counter() - t
        return times, len(example)


# ----------------------------------------------------------------------------- the peer


class PeerStep:
    """One optimizer step of speculators' ``PEagleDraftModel`` on the same sample and shapes."""

    def __init__(self, cfg, target_path: str, inputs):
        import speculators.models.peagle.core as peer_core
        from speculators.losses import resolve_loss_config
        from speculators.models.peagle import PEagleDraftModel
        from transformers import AutoConfig

        spec, train = inputs.spec, cfg.train
        layer = AutoConfig.from_pretrained(target_path)
        layer.num_hidden_layers, layer.num_attention_heads = spec.num_layers, spec.num_heads
        layer.num_key_value_heads, layer.head_dim = spec.num_kv_heads, spec.head_dim
        layer.intermediate_size = spec.intermediate_size
        draft_ids = torch.as_tensor(inputs.draft_ids, dtype=torch.long)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        torch.manual_seed(train.recipe.seed)
        self.model = PEagleDraftModel.from_training_args(
            layer, t2d=t2d, d2t=draft_ids - torch.arange(len(draft_ids)), verifier_name_or_path=target_path,
            draft_vocab_size=spec.draft_vocab_size, mask_token_id=spec.mask_token_id,
            target_layer_ids=list(spec.aux_layer_ids), num_depths=train.peagle.k_train,
            draft_attn_impl="sdpa")  # its default, flex attention, has no backward on the CPU
        self.model.train()
        self.kwargs = {"loss_config": resolve_loss_config("kl_div", "eager"), "num_depths": train.peagle.k_train,
                       "down_sample_ratio": train.peagle.cod_ratio, "down_sample_ratio_min": train.peagle.cod_floor,
                       "max_anchors": train.recipe.max_len}
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=train.recipe.learning_rate)
        self.max_len = train.recipe.max_len
        self._sampled, self._cod_s = 0, 0.0
        cod = peer_core.generate_cod_sample_indices

        def counted(*args, **kwargs):  # its COD sampling's elements (the step's size) and time
            start = time.perf_counter()
            anchor_pos, depth = cod(*args, **kwargs)
            self._sampled, self._cod_s = int(anchor_pos.shape[0]), time.perf_counter() - start
            return anchor_pos, depth

        peer_core.generate_cod_sample_indices = counted

    def __call__(self, sample, seed: int) -> tuple[dict, int]:
        n = min(len(sample.token_ids), self.max_len)
        hidden = sample.hidden[:n].float()  # [n, 4, H]: 3 aux layers, then the final layer
        torch.manual_seed(seed)  # its COD sampling draws from torch's global generator
        times, t = {}, time.perf_counter()
        _, loss, _ = self.model(
            hidden_states=hidden[:, :3].reshape(1, n, -1), input_ids=sample.token_ids[:n].long()[None],
            document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None],
            loss_mask=sample.loss_mask[:n].float()[None], verifier_last_hidden_states=hidden[None, :, 3],
            **self.kwargs)
        times["forward + loss"], t = time.perf_counter() - t - self._cod_s, time.perf_counter()
        times["COD sampling"] = self._cod_s
        loss.backward()
        times["backward"], t = time.perf_counter() - t, time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["optimizer"] = time.perf_counter() - t
        return times, self._sampled


# ----------------------------------------------------------------------------- measuring


PHASES = ["COD sampling", "forward + loss", "backward", "optimizer"]  # the mask is built in the forward


def measure(steps: dict, samples: list, warmup: int, reps: int) -> dict:
    """Per trainer and sample the best of ``reps`` steps (phases of that step), after untimed
    warm-up steps. The trainers take turns sample by sample, so a drift in the machine's speed
    reaches both alike."""
    for i in range(warmup):
        for step in steps.values():
            step(samples[i % len(samples)], seed=i)
    best: dict = {name: [] for name in steps}
    for i, sample in enumerate(samples):
        for name, step in steps.items():
            runs = [step(sample, seed=1000 + i) for _ in range(reps)]
            best[name].append(min(runs, key=lambda r: sum(r[0].values())))
    results = {}
    for name, runs in best.items():
        total = {p: sum(times.get(p, 0.0) for times, _ in runs) for p in PHASES}
        results[name] = {"phases_s": total, "step_s": sum(total.values()), "elements": sum(n for _, n in runs),
                         "trainable": steps[name].trainable}
    return results


def trainer_throughput(cfg, target, data_dir: Path) -> tuple[float, float]:
    """(mean seconds per optimizer step, tokens/s) of our real trainer (DeepSpeed, its launcher)
    on ``cfg``; its first step, which warms up, left out."""
    trained, _ = train_fresh(cfg, target, data_dir)
    steps = [r for r in trained.metrics_history if "step_time_s" in r][1:]
    seconds = sum(r["step_time_s"] for r in steps)
    return seconds / len(steps), sum(r["tokens"] for r in steps) / seconds


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--samples", type=int, default=24, help="training samples timed (the first ones)")
    parser.add_argument("--reps", type=int, default=2, help="steps per sample; the best counts")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--no-trainer", action="store_true", help="skip the real trainer's row")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random target and dataset, 4 samples, 1 rep, no trainer row")
    args = parser.parse_args()
    version = peer_available()
    if version is None:
        parser.error(f"the peer ({PEER}) is not installed: run `make bench-install` (it installs "
                     "pyproject.toml's bench extra, speculators and hs-connectors, without their dependencies)")
    if args.quick:
        args.samples, args.reps, args.no_trainer = 4, 1, True

    setup_head_bench(args.threads)
    with tempfile.TemporaryDirectory(prefix="peagle-bench-") as tmp:
        run = compare(args, version, Path(tmp))
    run.finish([f"peer: {PEER} {version}, PEagleDraftModel, loss kl_div (eager; its fused one is a Triton "
                "kernel), attention sdpa, uncompiled on CPU"])


def compare(args, version: str, tmp: Path) -> Run:
    from targets import bench_target

    from peagle.config import load_config
    from peagle.layout import RunLayout
    from peagle.train.trainer import load_training_inputs

    overrides = {"train.method": "peagle", **epochs_override(args.epochs)}
    if args.quick:  # the tiny target's positions
        overrides.update({"train.recipe.max_len": 64, "train.peagle.k_train": 3, "drafter.num_layers": 1, "eval.ks": [1, 3]})
    cfg = load_config(args.config, overrides)
    if args.quick:
        data_dir, target_dir = tiny_head_dataset(tmp)
    else:
        data_dir = Path(args.data_dir) if args.data_dir else RunLayout(cfg.run_dir).data.root
        target_dir = bench_target(cfg.target)
    target_path = str(target_dir)
    inputs = load_training_inputs(data_dir, cfg)
    samples = [inputs.samples[i] for i in range(min(args.samples, len(inputs.samples)))]
    tokens = sum(min(len(s.token_ids), cfg.train.recipe.max_len) for s in samples)
    stem = "tiny random target" if args.quick else Path(args.config).stem
    run = Run(NAME if args.quick else per_target_name(NAME, args.config), {**vars(args), "peer_version": version})

    results = measure({"peagle": OurStep(cfg, target_path, inputs), PEER: PeerStep(cfg, target_path, inputs)},
                      samples, args.warmup, args.reps)
    ours, peer = results["peagle"], results[PEER]
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['trainable'] / 1e6:.2f}", r["elements"], f"{1000 * r['step_s'] / len(samples):.1f}",
                     *[f"{1000 * r['phases_s'][p] / len(samples):.1f}" for p in PHASES],
                     f"{tokens / r['step_s']:.0f}", f"{peer['step_s'] / r['step_s']:.2f}x"])
    if not args.no_trainer:
        trainer_cfg = load_config(args.config, {**overrides, "train.recipe.max_steps": args.samples + 1, "train.recipe.epochs": 1,
                                                "train.method": "peagle", "train.baseline.eagle3": False,
                                                "workdir": str(tmp / "trainer")})  # never the config's own runs
        seconds, tokens_per_s = trainer_throughput(trainer_cfg, target_info(target_path, data_dir), data_dir)
        rows.append(["peagle trainer (DeepSpeed)", f"{ours['trainable'] / 1e6:.2f}", "", f"{1000 * seconds:.1f}",
                     *[""] * len(PHASES), f"{tokens_per_s:.0f}", f"{tokens_per_s / (tokens / peer['step_s']):.2f}x"])
    spec = inputs.spec
    run.add_table(
        f"Training step, one sample, fp32, {torch.get_num_threads()} thread(s): {stem} "
        f"(H {spec.hidden_size}, {spec.num_layers} layers, Vd {spec.draft_vocab_size}, K {cfg.train.peagle.k_train}, "
        f"COD {cfg.train.peagle.cod_ratio}/{cfg.train.peagle.cod_floor})",
        ["trainer", "trainable M", "elements", "ms/step", *[f"{p} ms" for p in PHASES], "tokens/s",
         f"speed vs {PEER}"], rows,
        note=f"{len(samples)} samples ({tokens} tokens), best of {args.reps} steps each after {args.warmup} "
             "warm-up steps; the trainer row: a fresh run of as many steps (its own sample order, its first step "
             "left out), tokens/s over its samples")
    run.meta.update({"results": results, "tokens": tokens, "samples": len(samples), "data_dir": str(data_dir)})
    return run


if __name__ == "__main__":
    main()
