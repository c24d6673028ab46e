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

Training batches carry no mask at all, only the elements' (anchor, depth, doc, valid)
vectors (``ElementAttention``), and the drafter evaluates the rule from them in one of
two forms on the batch's device:

- dense: ``element_mask``, a Bool [B, N, N] for SDPA - a compare over the depth-0 columns
  (the only ones whose pattern is not a chain) plus at most K-1 vectorised chain steps,
  no [N, N] integer temporaries;
- block-sparse: ``ElementAttention.block_mask``, flex attention's ``BlockMask``. Its
  ``mask_mod`` reads the four vectors per (query, key) pair, and which 128 x 128 tiles can
  hold an allowed pair comes from per-tile bounds of anchor and document (the context
  clause) and from the chains themselves (``chain_pairs``): O(N K) work and an int32 per
  tile, no [N, N] tensor at any point. Of a K_train 8, COD 0.8 example's tiles, 25% are
  visited at 2K tokens and 15% at 32K (bench/results/attention_memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

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
        self.device = torch.device(device)
        self._tril: torch.Tensor | None = None
        self.types = block_types(k)

    @property
    def tril(self) -> torch.Tensor:
        """The [max_len, max_len] context table, built on first use (``check`` alone never needs it)."""
        if self._tril is None:
            self._tril = torch.ones(self.max_len, self.max_len, dtype=torch.bool, device=self.device).tril()
        return self._tril

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
        self.check(anchor, depth)
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

    def check(self, anchor: torch.Tensor, depth: torch.Tensor) -> None:
        """Refuse elements outside the anchors (``max_len``) and depths (``k``) this mask is for."""
        if anchor.shape != depth.shape or anchor.dim() != 1:
            raise ValueError(f"anchor and depth must be 1-D of one length, got {tuple(anchor.shape)}, {tuple(depth.shape)}")
        if anchor.numel() and (int(anchor.max()) >= self.max_len or int(anchor.min()) < 0):
            raise ValueError(
                f"anchors reach {int(anchor.max())} but the mask was precomputed for max_len={self.max_len}: "
                "build PrecomputedMask with train.recipe.max_len"
            )
        if depth.numel() and (int(depth.max()) >= self.k or int(depth.min()) < 0):
            raise ValueError(f"depths reach {int(depth.max())} but the mask was precomputed for k={self.k}")


def _take_columns(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """rows[:, columns]; a slice when the columns are a contiguous ascending range."""
    if columns.numel() and int(columns[-1]) - int(columns[0]) + 1 == columns.numel():
        return rows[:, int(columns[0]) : int(columns[-1]) + 1]
    return rows[:, columns]


def element_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    doc: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [..., N, N]: the attention rule for [N] or [B, N] elements, in any order, on their device.

    Equal to ``brute_force_mask`` (with ``valid`` masking padding both ways). Work is one
    [N, #depth-0] compare (two with several documents) and at most K-1 gathers of N.
    """
    if anchor.dim() == 1:
        return element_mask(anchor[None], depth[None], None if doc is None else doc[None],
                            None if valid is None else valid[None])[0]
    b, n = anchor.shape
    doc = torch.zeros_like(anchor) if doc is None else doc
    valid = torch.ones_like(anchor, dtype=torch.bool) if valid is None else valid
    out = torch.zeros(b, n, n, dtype=torch.bool, device=anchor.device)
    for row in range(b):
        _context_columns(anchor[row], depth[row], doc[row], valid[row], out[row])
        _chain_pairs(anchor[row], depth[row], doc[row], valid[row], out[row])
    return out


def _context_columns(anchor, depth, doc, valid, out) -> None:
    """Depth-0 keys: q may read k when k's anchor <= q's anchor, same document, both valid.

    ``out`` is all False; in the builder's layout (depth 0 one block of columns) the compare
    writes straight into that block, with no [N, #depth-0] temporary.
    """
    cols = torch.nonzero(valid & (depth == 0)).squeeze(1)
    if not cols.numel():
        return
    first, last = int(cols[0]), int(cols[-1])
    block = last - first + 1 == cols.numel()
    target = out[:, first : last + 1] if block else torch.empty(out.shape[0], cols.numel(), dtype=torch.bool,
                                                                 device=out.device)
    torch.le(anchor[cols][None, :], anchor[:, None], out=target)
    doc_v = doc[valid]
    if doc_v.numel() and bool((doc_v != doc_v[0]).any()):
        target &= doc[cols][None, :] == doc[:, None]
    if not bool(valid.all()):
        target &= valid[:, None]
    if not block:
        out[:, cols] = target


def _chain_pairs(anchor, depth, doc, valid, out) -> None:
    """Deeper keys: q may read k of its own anchor and document with 0 < k.depth <= q.depth."""
    deep = torch.nonzero(valid & (depth > 0)).squeeze(1)
    out[deep, deep] = True  # a deeper element reads itself
    for q, k in chain_pairs(anchor, depth, doc, valid):
        key_deep = depth[k] > 0
        out[q[key_deep], k[key_deep]] = True


def chain_pairs(anchor, depth, doc, valid):
    """Yield (query, key) index pairs, [M] each, of every two real elements of one chain (same
    anchor and document) with key.depth <= query.depth: the chain clause of the rule.

    Sorted by (doc, anchor, depth), a chain is a run of consecutive elements: step j pairs
    each element with the one j places before it, until no run is longer than j. Two
    elements of the same (anchor, depth) read each other (both pairs are yielded).
    """
    idx = torch.nonzero(valid).squeeze(1)
    for key in (depth, anchor, doc):  # stable sorts, least significant key first
        idx = idx[torch.sort(key[idx], stable=True).indices]
    a, d, g = anchor[idx], depth[idx], doc[idx]
    for j in range(1, idx.numel()):
        same = (a[j:] == a[:-j]) & (g[j:] == g[:-j])
        if not bool(same.any()):
            break
        q, k = idx[j:][same], idx[:-j][same]
        tie = d[j:][same] == d[:-j][same]
        yield torch.cat([q, k[tie]]), torch.cat([k, q[tie]])


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


# ----------------------------------------------------------------------------- block-sparse (flex attention)

FLEX_BLOCK_SIZE = 128  # flex attention's tile (its default): one block-mask entry per 128 x 128 pairs
_NONE = 1 << 62  # a bound of an empty tile: no comparison with a real value holds


def rule_mask_mod(anchor: torch.Tensor, depth: torch.Tensor, doc: torch.Tensor, valid: torch.Tensor):
    """flex attention's ``mask_mod`` for [B, N] element vectors: the rule (``brute_force_mask``
    with ``valid``), plus every element reading itself, as the drafter's dense path has it
    (a padding row is then never empty)."""

    def mask_mod(b, h, q, kv):
        aq, ak, dq, dk = anchor[b, q], anchor[b, kv], depth[b, q], depth[b, kv]
        allowed = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))
        allowed = allowed & (doc[b, q] == doc[b, kv]) & valid[b, q] & valid[b, kv]
        return allowed | (q == kv)

    return mask_mod


@dataclass(frozen=True)
class ElementAttention:
    """The attention rule over a batch's elements, held as their [B, N] vectors.

    What ``PEagleDrafter.forward`` takes as its attention: ``dense()`` evaluates it as a
    Bool [B, N, N] mask, ``block_mask()`` as flex attention's block-sparse mask; the drafter
    picks one (``peagle.model.drafter.attention_backend``).
    """

    anchor: torch.Tensor  # Long [B, N]
    depth: torch.Tensor  # Long [B, N]
    doc: torch.Tensor  # Long [B, N]
    valid: torch.Tensor  # Bool [B, N], False on padding

    @property
    def shape(self) -> torch.Size:
        """[B, N]."""
        return self.anchor.shape

    def dense(self) -> torch.Tensor:
        """Bool [B, N, N]: ``element_mask``."""
        return element_mask(self.anchor, self.depth, self.doc, self.valid)

    def mask_mod(self):
        return rule_mask_mod(self.anchor, self.depth, self.doc, self.valid)

    def block_mask(self, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
        """flex attention's ``BlockMask`` of the rule ([B, 1, ...]: every head alike).

        A tile (query block i, key block j) is visited when some pair in it may be allowed:
        the lowest depth-0 anchor of j is at or before the highest query anchor of i and their
        documents' ranges meet (the context clause, bounded per tile), or it holds a pair of one
        chain (the chain clause, found exactly by ``chain_pairs``: N x K pairs at most), or
        i == j (every element reads itself). A visited
        tile is "full" (no ``mask_mod`` evaluated) when every key of j is a depth-0 element at
        or before every query anchor of i, all of one document; tiles that touch padding or
        the end of the sequence never are. The ``mask_mod`` decides every pair of the others.
        """
        n = self.shape[1]
        context = self.valid & (self.depth == 0)
        anchors = _tile_bounds(self.anchor, self.valid, block_size)  # (low, high) per tile, real elements
        docs = _tile_bounds(self.doc, self.valid, block_size)
        context_anchors = _tile_bounds(self.anchor, context, block_size)  # the tile's depth-0 elements only
        context_docs = _tile_bounds(self.doc, context, block_size)

        def q(t):  # [B, tiles] -> [B, tiles, 1]: as the query tile
            return t[:, :, None]

        def k(t):  # [B, tiles] -> [B, 1, tiles]: as the key tile
            return t[:, None, :]

        def overlap(query, key):
            return (q(query[0]) <= k(key[1])) & (k(key[0]) <= q(query[1]))

        reads_context = (k(context_anchors[0]) <= q(anchors[1])) & overlap(docs, context_docs)
        reads_chain = _chain_tiles(self.anchor, self.depth, self.doc, self.valid, block_size)
        itself = torch.eye(anchors[0].shape[1], dtype=torch.bool, device=self.anchor.device)
        visited = reads_context | reads_chain | itself
        query_whole = (_tile_count(self.valid, block_size) == block_size) & (docs[0] == docs[1])
        key_context = (_tile_count(context, block_size) == block_size) & (context_docs[0] == context_docs[1])
        full = (q(query_whole) & k(key_context) & (q(docs[0]) == k(context_docs[0]))
                & (k(context_anchors[1]) <= q(anchors[0])))
        partial = visited & ~full
        return BlockMask.from_kv_blocks(
            *_ordered(partial), *_ordered(full), BLOCK_SIZE=block_size, mask_mod=self.mask_mod(), seq_lengths=(n, n)
        )


def _tiles(values: torch.Tensor, fill, block_size: int) -> torch.Tensor:
    """[B, N] -> [B, tiles, block_size], the tail padded with ``fill``."""
    b, n = values.shape
    tiles = -(-n // block_size)
    return F.pad(values, (0, tiles * block_size - n), value=fill).view(b, tiles, block_size)


def _tile_bounds(values: torch.Tensor, keep: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``values`` over the ``keep`` elements of each tile, [B, tiles] each; an
    empty tile gets (+big, -big), so it never meets a real bound."""
    low = _tiles(torch.where(keep, values, _NONE), _NONE, block_size).amin(-1)
    high = _tiles(torch.where(keep, values, -_NONE), -_NONE, block_size).amax(-1)
    return low, high


def _chain_tiles(anchor, depth, doc, valid, block_size: int) -> torch.Tensor:
    """Bool [B, tiles, tiles]: the tiles holding a pair of the chain clause (``chain_pairs``), exactly."""
    b, n = anchor.shape
    tiles = -(-n // block_size)
    out = torch.zeros(b, tiles * tiles, dtype=torch.bool, device=anchor.device)
    for row in range(b):
        for q, k in chain_pairs(anchor[row], depth[row], doc[row], valid[row]):
            out[row, q // block_size * tiles + k // block_size] = True
    return out.view(b, tiles, tiles)


def _tile_count(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, tiles]: how many elements of each tile are ``keep`` (positions past N are not)."""
    return _tiles(keep.int(), 0, block_size).sum(-1)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Bool [B, query tiles, key tiles] as flex attention's (count [B, 1, Q], indices [B, 1, Q, K]):
    per query tile how many key tiles it visits, and which (those first)."""
    as_int = tiles.to(torch.int32)
    count = as_int.sum(-1, dtype=torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None].contiguous(), order[:, None].contiguous()
