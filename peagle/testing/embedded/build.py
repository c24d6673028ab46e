"""Build the tiny ``embedded`` test target: a small Llama code model trained on the stdlib, offline.

The build is a pure function of the recipe (plus BUILD_VERSION and this machine's stdlib):
the output directory is keyed by their hash, written to a temp dir and renamed into place,
so a directory that exists is always complete. ``build_report.json`` records what the
model learned (held-out loss, accuracy and greedy predictability, trained vs random init).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import resource
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from peagle.config import EmbeddedTargetRecipe
from peagle.fileio import staged_dir
from peagle.logs import console_stream
from peagle.target.embedded import BUILD_VERSION, REPORT_NAME, embedded_target_dir, is_complete, recipe_hash
from peagle.testing.embedded.corpus import Corpus, chat_examples, load_corpus, stdlib_root
from peagle.testing.embedded.tokenizer import END, render_chat, train_bpe, wrap_tokenizer

CHAT_FRACTION = 0.4  # share of training rows that are chat examples (the rest raw code)
WARMUP_FRACTION = 0.05
MIN_LR_RATIO = 0.1
EVAL_WINDOWS = 32
GREEDY_PROMPTS = 24
GREEDY_PROMPT_TOKENS = 64
GREEDY_NEW_TOKENS = 32


def build_embedded_target(recipe: EmbeddedTargetRecipe, force: bool = False, progress: bool = True) -> Path:
    """Return the cached target directory for ``recipe``, building it first if needed."""
    final = embedded_target_dir(recipe)
    if is_complete(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.with_name(final.name + ".lock")):
        if is_complete(final) and not force:
            return final  # another process built it while we waited
        for stale in final.parent.glob(f".{final.name}.*"):  # left by a killed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with staged_dir(final) as tmp:
            _build_into(tmp, recipe, progress)
    return final


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- the build


def _build_into(out: Path, recipe: EmbeddedTargetRecipe, progress: bool) -> None:
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    phases = PhaseTimer()
    torch.manual_seed(recipe.seed)
    with phases("corpus"):
        corpus = load_corpus(recipe.corpus_max_bytes, recipe.heldout_fraction, recipe.seed)
    with phases("tokenizer"):
        bpe = train_bpe((f.text for f in corpus.train), recipe.vocab_size)
        tokenizer = wrap_tokenizer(bpe, recipe.max_position_embeddings)
        data = TokenData.from_corpus(corpus, tokenizer)
    model = new_model(recipe, tokenizer)
    with phases("evaluate_random"):
        random_metrics = evaluate(model, data, recipe)
    with phases("train"):
        losses, step_seconds = train(model, data, recipe, progress)
    with phases("evaluate_trained"):
        trained_metrics = evaluate(model, data, recipe)

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation_config(tokenizer).save_pretrained(out)
    report = {
        "build_version": BUILD_VERSION,
        "recipe_hash": recipe_hash(recipe),
        "recipe": recipe.model_dump(mode="json"),
        "params": sum(p.numel() for p in model.parameters()),
        "corpus": {**corpus.stats(), "stdlib": str(stdlib_root()), "python": platform.python_version(), **data.stats()},
        "trained": trained_metrics,
        "random_init": random_metrics,
        "train_loss_curve": losses,
        "seconds_per_step": round(step_seconds, 4),
        "phase_seconds": phases.seconds,
        "build_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(_cpu_seconds() - cpu_start, 1),  # over the wall time: how many cores it kept busy
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "sample_chat_completion": sample_completion(model, tokenizer, data),
    }
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2))


def _cpu_seconds() -> float:
    """CPU time of this process (all threads): a load-independent measure of build cost."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class PhaseTimer:
    """Wall-clock seconds per build phase, for the report."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 1)


class TokenData:
    """Token streams for training (code + chat) and held-out evaluation."""

    def __init__(self, train_code, train_chat, heldout_code, heldout_chat, eos_id):
        self.train_code = train_code  # LongTensor: train files joined by eos
        self.train_chat = train_chat  # list[LongTensor]: one rendered conversation each
        self.heldout_code = heldout_code
        self.heldout_chat = heldout_chat
        self.eos_id = eos_id

    @classmethod
    def from_corpus(cls, corpus: Corpus, tokenizer: PreTrainedTokenizerFast) -> TokenData:
        eos = tokenizer.convert_tokens_to_ids(END)

        def code_stream(files):
            ids = []
            for enc in tokenizer.backend_tokenizer.encode_batch([f.text for f in files]):
                ids.extend(enc.ids + [eos])
            return torch.tensor(ids, dtype=torch.long)

        def chats(files):
            texts = [render_chat(ex.messages()) for ex in chat_examples(files)]
            return [torch.tensor(e.ids, dtype=torch.long) for e in tokenizer.backend_tokenizer.encode_batch(texts)]

        return cls(code_stream(corpus.train), chats(corpus.train), code_stream(corpus.heldout), chats(corpus.heldout), eos)

    def stats(self) -> dict:
        return {
            "train_code_tokens": len(self.train_code),
            "train_chat_examples": len(self.train_chat),
            "train_chat_tokens": sum(len(c) for c in self.train_chat),
            "heldout_code_tokens": len(self.heldout_code),
            "heldout_chat_examples": len(self.heldout_chat),
        }

    def train_batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """Rows of ``seq_len`` tokens: random code windows, or chats packed from an example start."""
        rows = []
        for _ in range(batch_size):
            if self.train_chat and torch.rand((), generator=gen) < CHAT_FRACTION:
                rows.append(self._chat_row(seq_len, gen))
            else:
                start = torch.randint(0, max(1, len(self.train_code) - seq_len), (), generator=gen)
                rows.append(_fit(self.train_code[start : start + seq_len], seq_len, self.eos_id))
        return torch.stack(rows)

    def _chat_row(self, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        i = int(torch.randint(0, len(self.train_chat), (), generator=gen))
        parts, n = [], 0
        while n < seq_len:
            parts.append(self.train_chat[i % len(self.train_chat)])
            n += len(parts[-1])
            i += 1
        return torch.cat(parts)[:seq_len]

    def eval_windows(self, seq_len: int) -> torch.Tensor:
        """Evenly spaced held-out code windows (the same for every model)."""
        n = len(self.heldout_code)
        count = max(1, min(EVAL_WINDOWS, n // seq_len))
        starts = torch.linspace(0, max(0, n - seq_len - 1), count).long()
        return torch.stack([_fit(self.heldout_code[s : s + seq_len], seq_len, self.eos_id) for s in starts])


def _fit(ids: torch.Tensor, length: int, pad_id: int) -> torch.Tensor:
    if len(ids) >= length:
        return ids[:length]
    return torch.cat([ids, torch.full((length - len(ids),), pad_id, dtype=ids.dtype)])


def new_model(recipe: EmbeddedTargetRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False)


def lr_at(step: int, recipe: EmbeddedTargetRecipe) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO of the peak."""
    warmup = max(1, int(recipe.train_steps * WARMUP_FRACTION))
    if step < warmup:
        return recipe.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, recipe.train_steps - warmup)
    return recipe.learning_rate * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, data: TokenData, recipe: EmbeddedTargetRecipe, progress: bool):
    """AdamW under bf16 autocast (AMX on CPU); returns the loss curve and seconds per step."""
    gen = torch.Generator().manual_seed(recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    curve, start = [], time.perf_counter()
    bar = tqdm(range(recipe.train_steps), desc="training embedded target", disable=not progress,
               file=console_stream())
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        batch = data.train_batch(recipe.batch_size, recipe.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == recipe.train_steps - 1:
            curve.append([step, round(loss.item(), 4)])
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return curve, (time.perf_counter() - start) / recipe.train_steps


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: TokenData, recipe: EmbeddedTargetRecipe) -> dict:
    """Held-out next-token loss / top-1 accuracy, and how predictable greedy continuations are."""
    model.eval()
    windows = data.eval_windows(recipe.seq_len)
    logits = model(input_ids=windows).logits[:, :-1].float()
    labels = windows[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return {
        "heldout_loss": round(loss.item(), 4),
        "heldout_top1_accuracy": round(accuracy.item(), 4),
        "heldout_chat_loss": _chat_loss(model, data),
        **_greedy_predictability(model, data),
    }


def _chat_loss(model: LlamaForCausalLM, data: TokenData) -> float | None:
    """Loss on held-out conversations (the turns regeneration will produce); None without any."""
    total, count = 0.0, 0
    for ids in data.heldout_chat[:EVAL_WINDOWS]:
        out = model(input_ids=ids[None], labels=ids[None])
        total += out.loss.item() * (len(ids) - 1)
        count += len(ids) - 1
    return round(total / count, 4) if count else None


def _greedy_predictability(model: LlamaForCausalLM, data: TokenData) -> dict:
    """Greedy-decode from held-out code prefixes and compare with the real continuation.

    ``greedy_match_rate``: share of generated tokens equal to the real next token at that
    position; ``greedy_prefix_match``: mean tokens generated before the first mismatch;
    ``greedy_token_prob``: mean probability the model gives its own greedy tokens (how
    sure, hence how draftable, its output is).
    """
    span = GREEDY_PROMPT_TOKENS + GREEDY_NEW_TOKENS
    n = len(data.heldout_code)
    count = max(1, min(GREEDY_PROMPTS, n // span))
    starts = torch.linspace(0, max(0, n - span - 1), count).long()
    seqs = torch.stack([_fit(data.heldout_code[s : s + span], span, data.eos_id) for s in starts])
    prompts, truth = seqs[:, :GREEDY_PROMPT_TOKENS], seqs[:, GREEDY_PROMPT_TOKENS:]
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=GREEDY_NEW_TOKENS,
        min_new_tokens=GREEDY_NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=data.eos_id,
    )
    generated = out.sequences[:, GREEDY_PROMPT_TOKENS:]
    probs = torch.stack(out.scores, 1).float().softmax(-1).max(-1).values
    match = generated == truth
    prefix = match.int().cumprod(1).sum(1).float()
    return {
        "greedy_match_rate": round(match.float().mean().item(), 4),
        "greedy_prefix_match": round(prefix.mean().item(), 3),
        "greedy_token_prob": round(probs.mean().item(), 4),
    }


@torch.no_grad()
def sample_completion(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, data: TokenData) -> str:
    """One greedy chat answer to a held-out prompt, for a human to read in the report."""
    if not data.heldout_chat:
        return ""
    ids = data.heldout_chat[0]
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    cut = (ids == assistant).nonzero()[0, 0].item() + 2  # through "<|assistant|>\n"
    out = model.generate(input_ids=ids[None, :cut], attention_mask=torch.ones(1, cut, dtype=torch.long),
                         max_new_tokens=96, do_sample=False)
    return tokenizer.decode(out[0])
