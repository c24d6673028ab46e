"""Target hidden states for whole token sequences, computed by vLLM.

Each sequence (prompt + regenerated response, already tokenized) is sent whole as a
prompt with ``max_tokens=1`` to an engine started with vLLM's ``extract_hidden_states``
method; our connector (``peagle.serving.connector``) writes the residual stream after
each requested layer to one file per request, which is read, checked and deleted here.

Layer id k is the residual stream after k decoder layers (HF ``hidden_states[k]``);
k = L, the last layer, is captured PRE-norm (HF's last ``hidden_states`` entry is
post-norm). vLLM 0.32 captures every id in [0, L].

The same engine also generates correctly (the extraction "drafter" only proposes the
token just sampled, so verification keeps the target's own outputs), so
``open_data_engine`` gives the data stage one engine for regeneration and extraction.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import torch

from peagle.config import VllmConfig
from peagle.facts import text_config


def target_num_layers(model: str, *, revision: str | None = None, trust_remote_code: bool = False) -> int:
    """The target's decoder depth L, read from its config (text part for multimodal models)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    return int(text_config(config).num_hidden_layers)


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Layer ids must be strictly ascending in [0, L]: vLLM returns captures in sorted order."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("layer_ids is empty: name the target layers to extract (e.g. HeadSpec.stored_layer_ids)")
    if ids != sorted(set(ids)):
        raise ValueError(f"layer_ids {ids} must be strictly ascending (vLLM stores captures in sorted order)")
    if ids[0] < 0 or ids[-1] > num_layers:
        raise ValueError(
            f"layer_ids {ids} must lie in [0, {num_layers}] for a {num_layers}-layer target "
            f"(id k = residual stream after k layers; {num_layers} = the last layer, pre-norm)"
        )
    return ids


@contextmanager
def open_data_engine(
    model: str,
    vllm_cfg: VllmConfig,
    layer_ids: list[int],
    work_dir: Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
):
    """One vLLM engine for the whole data stage: regeneration and extraction.

    With ``vllm.data_parallel_size`` = N > 1 it is an ``EnginePool`` of N replicas, each
    writing its hidden-state files into a directory of its own. Use it with
    ``peagle.data.regenerate.regenerate_responses`` and ``extract_with_engine``.
    Hidden-state files are written under ``work_dir/hidden_states`` and deleted once read.
    """
    from peagle.serving.extraction import extraction_engine_kwargs
    from peagle.serving.pool import open_engines

    layer_ids = check_layer_ids(
        layer_ids, target_num_layers(model, revision=revision, trust_remote_code=trust_remote_code)
    )
    files_dir = _fresh_dir(Path(work_dir) / "hidden_states")
    try:
        with open_engines(
            model,
            vllm_cfg,
            revision=revision,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            replica_options=lambda rank: extraction_engine_kwargs(layer_ids, files_dir / f"replica-{rank}"),
        ) as llm:
            llm.peagle_layer_ids = layer_ids
            yield llm
    finally:
        shutil.rmtree(files_dir, ignore_errors=True)


def extract_with_engine(
    llm,
    sequences: Iterable[tuple[str, list[int]]],
    *,
    batch_size: int = 32,
    progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(sample_id, hidden [T, len(layer_ids), Ht])`` per sequence, in input order.

    ``llm`` comes from ``open_data_engine``; the dtype is the engine's (model) dtype.
    """
    from tqdm.auto import tqdm

    from peagle.logs import console_stream
    from peagle.serving.extraction import request_hidden_states
    from peagle.serving.pool import engine_max_model_len, engine_vocab_size

    max_len, vocab = engine_max_model_len(llm), engine_vocab_size(llm)
    total = len(sequences) if hasattr(sequences, "__len__") else None
    bar = tqdm(total=total, desc="extract hidden states", unit="seq", disable=not progress,
               file=console_stream())
    iterator = iter(sequences)
    try:
        while batch := list(islice(iterator, batch_size)):
            good, problem = _split_at_first_problem(batch, max_len, vocab)
            paths = request_hidden_states(llm, [list(ids) for _, ids in good]) if good else []
            for (sample_id, ids), path in zip(good, paths, strict=True):
                bar.update(1)
                yield sample_id, _read_checked(sample_id, ids, path)
            if problem:
                raise ValueError(problem)
    finally:
        bar.close()


def extract_hidden_states(
    model: str,
    vllm_cfg: VllmConfig,
    sequences: Iterable[tuple[str, list[int]]],
    layer_ids: list[int],
    work_dir: Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    batch_size: int = 32,
    progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Start an extraction engine, yield ``(sample_id, hidden [T, len(layer_ids), Ht])``.

    With ``vllm_cfg.data_parallel_size`` = N > 1, N engine replicas run in their own
    processes (``peagle.serving.pool``), each batch split over them. Engines stop when the
    iterator is exhausted or closed.
    """
    with open_data_engine(
        model, vllm_cfg, layer_ids, work_dir, revision=revision, trust_remote_code=trust_remote_code, dtype=dtype
    ) as llm:
        yield from extract_with_engine(llm, sequences, batch_size=batch_size, progress=progress)


def _split_at_first_problem(batch, max_len: int, vocab: int) -> tuple[list, str | None]:
    """The sequences before the first bad one (still extracted), and what is wrong with it."""
    for i, (sample_id, ids) in enumerate(batch):
        if problem := _sequence_problem(sample_id, ids, max_len, vocab):
            return batch[:i], problem
    return batch, None


def _read_checked(sample_id: str, ids: list[int], path: str) -> torch.Tensor:
    """Load (and delete) one request's file; it must hold exactly the sequence sent."""
    from peagle.serving.connector import read_hidden_states_file

    data = read_hidden_states_file(path, delete=True)
    if data["token_ids"].tolist() != list(ids):
        raise RuntimeError(f"sample {sample_id!r}: the hidden-states file {path} holds another sequence")
    return data["hidden_states"]


def _sequence_problem(sample_id: str, ids: list[int], max_len: int, vocab: int) -> str | None:
    if len(ids) == 0:
        return f"sample {sample_id!r}: empty token sequence"
    if len(ids) >= max_len:
        return (
            f"sample {sample_id!r}: {len(ids)} tokens do not fit vllm.max_model_len={max_len} "
            "(extraction needs one spare position); drop longer samples (data.max_seq_len) or raise max_model_len"
        )
    if min(ids) < 0 or max(ids) >= vocab:
        return f"sample {sample_id!r}: token ids outside the target vocabulary [0, {vocab})"
    return None


def _fresh_dir(path: Path) -> Path:
    """An empty directory: files left by a crashed run would never be read."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
