"""P-EAGLE attention masks, precomputed once for the maximum length (paper, section 3.1).

Element q = (anchor, depth) may attend to element k iff

    (k.depth == 0 and k.anchor <= q.anchor)        all real context up to q's anchor
    or (k.anchor == q.anchor and k.depth <= q.depth)   q's own chain of placeholders

and both are in the same document. Over (depth, anchor) pairs laid out depth-major,
the full [K*L, K*L] mask is made of only three L x L blocks: ``tril`` (key depth 0),
``eye`` (0 < key depth <= query depth) and empty. ``PrecomputedMask`` stores ``tril``
once; an example's mask is a slice of it to the example's length plus a gather of the
COD-selected anchors (rows) for every key-depth-0 block, one True per row placed by a
sorted search in each ``eye`` block, and False elsewhere: no per-pair rule evaluation.
"""

from __future__ import annotations

import torch

NONE, TRIL, EYE = 0, 1, 2


def block_types(k: int) -> torch.Tensor:
    """Long[K, K]: which block sits at (query depth, key depth)."""
    dq = torch.arange(k)[:, None]
    dk = torch.arange(k)[None, :]
    types = torch.full((k, k), NONE, dtype=torch.long)
    types[(dk > 0) & (dk <= dq)] = EYE
    types[:, 0] = TRIL
    return types


class PrecomputedMask:
    """The cross-depth mask structure for anchors < ``max_len`` and depths < ``k``."""

    def __init__(self, max_len: int, k: int, device: torch.device | str = "cpu"):
        if max_len < 1 or k < 1:
            raise ValueError(f"PrecomputedMask needs max_len >= 1 and k >= 1, got {max_len}, {k}")
        self.max_len, self.k = max_len, k
        self.tril = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()
        self.types = block_types(k)

    def mask_for(
        self,
        anchor: torch.Tensor,
        depth: torch.Tensor,
        doc: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bool[N, N] mask of N distinct (anchor, depth) elements, in any order.

        Fastest for the builder's layout (depth-major, anchors ascending); other orders
        are sorted, built and permuted back. ``out`` (a [N, N] bool view, e.g. a slice of
        the batch mask) is filled in place; every entry is written.
        """
        device = self.tril.device
        anchor, depth = anchor.to(device), depth.to(device)
        self._check(anchor, depth)
        n_el = anchor.numel()
        if out is None:
            out = torch.empty(n_el, n_el, dtype=torch.bool, device=device)
        if n_el == 0:
            return out
        key = depth * self.max_len + anchor
        ordered = bool((key[1:] > key[:-1]).all())
        if not ordered:
            order = torch.argsort(key)
            if bool((key[order][1:] == key[order][:-1]).any()):
                raise ValueError("mask_for got the same (anchor, depth) element twice")
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(n_el, device=device)
            sorted_doc = None if doc is None else doc.to(device)[order]
            built = self.mask_for(anchor[order], depth[order], sorted_doc)
            return out.copy_(built[inverse][:, inverse])
        context = self._context(anchor, doc)
        counts = torch.bincount(depth, minlength=self.k).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        anchors_at = [anchor[starts[d] : starts[d + 1]] for d in range(self.k)]
        for dq in range(self.k):
            if not counts[dq]:
                continue
            rows, aq = slice(starts[dq], starts[dq + 1]), anchors_at[dq]
            out[rows, : starts[1]] = _take_columns(context[aq], anchors_at[0])  # TRIL block
            out[rows, starts[1] :] = False
            for dk in range(1, self.k):  # EYE blocks: one True where the anchors match
                if int(self.types[dq, dk]) != EYE or not counts[dk]:
                    continue
                ak = anchors_at[dk]
                pos = torch.searchsorted(ak, aq).clamp_max(len(ak) - 1)
                hit = (ak[pos] == aq).nonzero().squeeze(1)
                out[starts[dq] + hit, starts[dk] + pos[hit]] = True
        return out

    def _context(self, anchor: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
        """The anchor-level [n, n] context table: the precomputed tril, sliced, per document."""
        n = int(anchor.max()) + 1
        context = self.tril[:n, :n]
        if doc is None:
            return context
        doc = doc.to(anchor.device)
        if not bool((doc != doc[0]).any()):
            return context
        anchor_doc = torch.full((n,), -1, dtype=doc.dtype, device=anchor.device)
        anchor_doc[anchor] = doc
        if not bool((anchor_doc[anchor] == doc).all()):
            raise ValueError("an anchor appears in two documents: packed documents need disjoint anchor ranges")
        return context & (anchor_doc[:, None] == anchor_doc[None, :])

    def _check(self, anchor: torch.Tensor, depth: torch.Tensor) -> None:
        if anchor.shape != depth.shape or anchor.dim() != 1:
            raise ValueError(f"anchor and depth must be 1-D of one length, got {tuple(anchor.shape)}, {tuple(depth.shape)}")
        if anchor.numel() and (int(anchor.max()) >= self.max_len or int(anchor.min()) < 0):
            raise ValueError(
                f"anchors reach {int(anchor.max())} but the mask was precomputed for max_len={self.max_len}: "
                "build PrecomputedMask with train.max_len"
            )
        if depth.numel() and (int(depth.max()) >= self.k or int(depth.min()) < 0):
            raise ValueError(f"depths reach {int(depth.max())} but the mask was precomputed for k={self.k}")


def _take_columns(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """rows[:, columns]; a slice when the columns are a contiguous ascending range."""
    if columns.numel() and int(columns[-1]) - int(columns[0]) + 1 == columns.numel():
        return rows[:, int(columns[0]) : int(columns[-1]) + 1]
    return rows[:, columns]


def brute_force_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    doc: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: evaluate the attention rule for every pair (O(N^2) per example)."""
    aq, ak = anchor[:, None], anchor[None, :]
    dq, dk = depth[:, None], depth[None, :]
    allowed = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))
    if doc is not None:
        allowed &= doc[:, None] == doc[None, :]
    if valid is not None:
        allowed &= valid[:, None] & valid[None, :]
    return allowed
