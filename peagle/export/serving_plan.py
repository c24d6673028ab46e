"""What ``peagle serve`` serves for a head directory: its target, K, parallel drafting and model
name, read from the head's weights and its card's serve line (``peagle pull`` writes them there)."""

from __future__ import annotations

from pathlib import Path

from peagle.contract import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE, drafts_in_parallel
from peagle.export.card import TARGET_PLACEHOLDER, read_serve_line
from peagle.serving.server import HeadServing

DEFAULT_K = 5  # the paper's serving K, for a head whose card does not say


def plan_serving(head_dir: str | Path, *, target: str | None = None, k: int | None = None,
                 served_name: str | None = None) -> HeadServing:
    """Check ``head_dir`` and fill what the caller left out from the head itself.

    Parallel drafting follows the weights (only a head shipping ``mask_hidden`` drafts in
    parallel); the target, K and the served model name default to the card's serve line
    (``peagle pull`` writes them there: the name is the head's registered name).
    """
    head_dir = Path(head_dir).expanduser().resolve()
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (head_dir / f).is_file()]
    if missing:
        raise ValueError(f"{head_dir} is not a head directory (no {', '.join(missing)}); "
                         "pull one with `peagle pull models:/<name>@champion DIR`")
    try:
        parallel = drafts_in_parallel(head_dir)
    except ValueError as err:
        raise ValueError(f"{err}. The head is truncated or corrupt: pull it again (`peagle pull "
                         f"models:/<name>@champion {head_dir} --overwrite`) or export it again (`peagle export CONFIG`)"
                         ) from None
    card = head_dir / CARD_FILE
    line = read_serve_line(card.read_text()) if card.is_file() else None
    if target is None:
        target = line.target_ref if line else None
        if target in (None, TARGET_PLACEHOLDER):
            raise ValueError(f"{head_dir}'s card names no target; pass --target with the target's hub id or "
                             "local path (or pull the head with `peagle pull ... --target`)")
    if k is None:
        k = line.k if line else DEFAULT_K
    if served_name is None and line:
        served_name = line.served_name
    if k < 1:
        raise ValueError(f"-K {k}: the number of speculative tokens must be at least 1")
    local = Path(target).expanduser()
    return HeadServing(str(local.resolve()) if local.exists() else target, head_dir, k, parallel, served_name)
