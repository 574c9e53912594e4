"""Independent PyTorch re-implementation of the KV-policy math (paper / authors' semantics).

Written from the papers and DESIGN.md ("The methods"), not from kvserve's C++: PyramidKV budgets,
SnapKV-style window scores, DynamicKV Algorithm 1, StreamingLLM, key-L2-norm and H2O selection.
Deliberately plain: per-head Python sorting for ties, dense attention, explicit pooling windows.
Importable by other tests (e.g. end-to-end checks on fixture models that dump q/k per layer).

Conventions: q [H, T, D] post-RoPE queries, k [KV, T, D] post-RoPE keys (H % KV == 0); kept
positions are per KV head, sorted ascending; ties go to the lower position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "pyramid_budgets",
    "window_scores",
    "accumulated_scores",
    "key_norm_scores",
    "top_positions",
    "RefPolicy",
    "select_layers",
    "dynamickv",
    "compare_kept",
]


# ----------------------------------------------------------------------------- budgets


def pyramid_budgets(prompt_len: int, budget: int, window: int, beta: int, num_layers: int) -> list[int]:
    """PyramidKV kept tokens per layer (window included), the authors' integer arithmetic."""
    if prompt_len <= budget:
        return [prompt_len] * num_layers
    a = max(budget - window, 0)
    if prompt_len < 2 * a or num_layers == 1:
        return [a + window] * num_layers
    lo = a // beta
    hi = 2 * a - lo
    if hi >= prompt_len - window:
        hi = prompt_len - window
        lo = 2 * a - hi
    steps = (hi - lo) // (num_layers - 1)
    return [hi - layer * steps + window for layer in range(num_layers)]


# ----------------------------------------------------------------------------- scores


def _attention_rows(q: torch.Tensor, k: torch.Tensor, rows: range) -> torch.Tensor:
    """Causal softmax attention of the query rows `rows` over all keys, per query head: [H, len(rows), T]."""
    h, _, d = q.shape
    kv, t, _ = k.shape
    group = h // kv
    out = torch.empty(h, len(rows), t, dtype=torch.float32)
    for head in range(h):
        keys = k[head // group].float()
        queries = q[head, rows.start : rows.stop].float()
        logits = queries @ keys.T / math.sqrt(d)
        for i, pos in enumerate(rows):
            logits[i, pos + 1 :] = float("-inf")
        out[head] = torch.softmax(logits, dim=-1)
    return out


def _pool(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """Stride-1 pooling with padding kernel//2 along the last dim; avg counts the zero padding."""
    pad = kernel // 2
    if pooling == "max":
        padded = torch.nn.functional.pad(x, (pad, pad), value=float("-inf"))
        return padded.unfold(-1, kernel, 1).amax(-1)
    if pooling == "avg":
        padded = torch.nn.functional.pad(x, (pad, pad), value=0.0)
        return padded.unfold(-1, kernel, 1).sum(-1) / kernel
    raise ValueError(pooling)


def window_scores(
    q: torch.Tensor, k: torch.Tensor, window: int, kernel: int = 7, pooling: str = "max", reduce: str = "sum"
) -> torch.Tensor:
    """Window-attention score per (KV head, prefix position): [KV, T - window] fp32.

    The last `window` queries attend (causally inside the window) to all keys; the attention on the
    prefix is summed (or averaged) over the window queries, pooled per query head, then averaged
    over the query heads of each KV head.
    """
    h = q.shape[0]
    kv, t, _ = k.shape
    n = t - window
    if q.shape[1] == t:
        probs = _attention_rows(q, k, range(t - window, t))
    else:
        probs = _attention_rows_window_only(q, k, window)
    prefix = probs[:, :, :n]
    per_head = prefix.sum(1) if reduce == "sum" else prefix.mean(1)
    pooled = _pool(per_head, kernel, pooling)
    return pooled.reshape(kv, h // kv, n).mean(1)


def _attention_rows_window_only(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """Like _attention_rows for q holding only the window's queries (q.shape[1] == window)."""
    t = k.shape[1]
    padded = torch.zeros(q.shape[0], t, q.shape[2], dtype=q.dtype)
    padded[:, t - window :] = q[:, -window:]
    return _attention_rows(padded, k, range(t - window, t))


def accumulated_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """H2O: attention each key receives from all queries that see it, / their count; [KV, T]."""
    h = q.shape[0]
    kv, t, _ = k.shape
    probs = _attention_rows(q, k, range(0, t))  # [H, T, T] (test sizes only)
    received = probs.sum(1) / torch.arange(t, 0, -1, dtype=torch.float32)
    return received.reshape(kv, h // kv, t).mean(1)


def key_norm_scores(k: torch.Tensor) -> torch.Tensor:
    """-||k||_2 over head_dim in fp32: [KV, T]."""
    return -k.float().pow(2).sum(-1).sqrt()


def top_positions(scores: torch.Tensor, n: int) -> list[list[int]]:
    """Per row: the n best positions by (score desc, position asc), sorted ascending."""
    out = []
    for row in scores.tolist():
        order = sorted(range(len(row)), key=lambda p: (-row[p], p))
        out.append(sorted(order[:n]))
    return out


def _rank(row: list[float]) -> list[int]:
    return sorted(range(len(row)), key=lambda p: (-row[p], p))


# ----------------------------------------------------------------------------- policies


@dataclass
class RefPolicy:
    """The paper-semantics parameters the reference needs (names as in kvserve's --param keys)."""

    name: str
    budget: int = 128
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    beta: int = 20
    r_max: int = 10
    update_interval: int = 4
    sink: int = 4
    skip_layers: list[int] = field(default_factory=list)


def select_layers(policy: RefPolicy, qs: list[torch.Tensor], ks: list[torch.Tensor]):
    """Kept positions per layer for uniform/pyramid policies: (budgets, kept[layer][kv_head])."""
    num_layers = len(ks)
    kv, t, _ = ks[0].shape
    w = policy.window
    if policy.name == "dynamickv":
        return dynamickv(policy, qs, ks)
    if policy.name == "pyramidkv":
        kept_counts = pyramid_budgets(t, policy.budget, w, policy.beta, num_layers)
    else:
        kept_counts = [min(t, policy.budget)] * num_layers
    budgets, kept = [], []
    for layer in range(num_layers):
        full = t <= policy.budget or layer in policy.skip_layers
        if full:
            budgets.append(t)
            kept.append([list(range(t)) for _ in range(kv)])
            continue
        n_scored = kept_counts[layer] - w
        if policy.name in ("snapkv", "pyramidkv"):
            scores = window_scores(qs[layer], ks[layer], w, policy.kernel, policy.pooling, "sum")
        elif policy.name == "h2o":
            scores = accumulated_scores(qs[layer], ks[layer])[:, : t - w]
        elif policy.name == "knorm":
            scores = key_norm_scores(ks[layer])[:, : t - w]
        elif policy.name == "streamingllm":
            recent = n_scored + w - policy.sink
            heads = [list(range(policy.sink)) + list(range(t - recent, t)) for _ in range(kv)]
            budgets.append(n_scored + w)
            kept.append(heads)
            continue
        else:
            raise ValueError(policy.name)
        heads = [row + list(range(t - w, t)) for row in top_positions(scores, n_scored)]
        budgets.append(n_scored + w)
        kept.append(heads)
    return budgets, kept


def _rebudget(hits: list[int], bs: int, base: int, num_layers: int, cap: int, current: list[int]) -> list[int]:
    """Update_Buffer_Length: hits // l, normalise, int(bs * frac), rescale to base*L, cap, only shrink."""
    n = len(hits)
    c = [x // n for x in hits]
    if sum(c) == 0:
        c = list(hits)
    total_c = sum(c)
    b = [bs * x // total_c for x in c] if total_c else [0] * n
    total = base * num_layers
    if sum(b) == 0:
        b = [total // n] * n
    else:
        sb = sum(b)
        b = [x * total // sb for x in b]
    b[-1] += total - sum(b)
    return [max(0, min(x, cap, cur)) for x, cur in zip(b, current)]


def dynamickv(policy: RefPolicy, qs: list[torch.Tensor], ks: list[torch.Tensor]):
    """DynamicKV Algorithm 1 (paper semantics, DESIGN.md): (budgets, kept[layer][kv_head])."""
    num_layers = len(ks)
    kv, t, _ = ks[0].shape
    w = policy.window
    if t <= policy.budget:
        return [t] * num_layers, [[list(range(t)) for _ in range(kv)] for _ in range(num_layers)]
    base = policy.budget - w
    bs = min(policy.r_max * base, t - w)
    cap = t - w
    budget = [bs] * num_layers
    scores: list[torch.Tensor] = []
    ranks: list[list[list[int]]] = []

    def update(n: int) -> None:
        flat = torch.cat([s.reshape(-1) for s in scores[:n]])
        order = torch.sort(flat, descending=True, stable=True).indices[: base * kv * n]
        hits = torch.bincount(order // (kv * cap), minlength=n).tolist()
        new = _rebudget(hits, bs, base, num_layers, cap, budget[:n])
        budget[:n] = new

    for layer in range(num_layers):
        s = window_scores(qs[layer], ks[layer], w, policy.kernel, policy.pooling, "mean")
        scores.append(s)
        ranks.append([_rank(row) for row in s.tolist()])
        if (layer + 1) % policy.update_interval == 0:
            update(layer + 1)
    if num_layers % policy.update_interval != 0:
        update(num_layers)
    kept = []
    for layer in range(num_layers):
        kept.append([sorted(r[: budget[layer]]) + list(range(t - w, t)) for r in ranks[layer]])
    return [b + w for b in budget], kept


# ----------------------------------------------------------------------------- comparison


def compare_kept(got: list[int], want: list[int], scores: list[float] | None, rtol: float = 1e-6) -> int:
    """Asserts two kept sets of one (layer, head) agree, except that positions whose scores tie
    within `rtol` (relative) with the selection boundary may swap. Returns the number of swaps."""
    g, w = set(got), set(want)
    assert len(got) == len(want), f"kept {len(got)} positions, expected {len(want)}"
    if g == w:
        return 0
    assert scores is not None, f"kept sets differ and no scores to explain it: {sorted(g ^ w)[:10]}"
    only_got, only_want = sorted(g - w), sorted(w - g)
    boundary = min(scores[p] for p in w)
    for p in only_got + only_want:
        s = scores[p]
        assert abs(s - boundary) <= rtol * max(abs(boundary), abs(s), 1e-30), (
            f"position {p} score {s!r} is not a tie with the boundary {boundary!r} "
            f"(only kvserve: {only_got[:10]}, only reference: {only_want[:10]})"
        )
    return len(only_got)


# ----------------------------------------------------------------------------- DynamicKV variants


@dataclass
class DynOptions:
    """DynamicKV beyond the paper (docs/eval/dynamickv.md): names as kvserve's --param keys."""

    variant: str = "paper"      # paper | authors (ranked per query head, union per KV head)
    normalize: str = "none"     # none | kth
    norm_rank: float = 1.0      # kth: each head's (norm_rank * base)-th best scores 1
    min_ratio: float = 0.0      # per-layer minimum, a fraction of base
    prior: str = "none"         # none | pyramid
    prior_weight: float = 0.5


def _head_scores(q: torch.Tensor, k: torch.Tensor, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Per query head window scores (summed over the window, pooled): [H, T - window]."""
    t = k.shape[1]
    probs = _attention_rows(q, k, range(t - window, t)) if q.shape[1] == t else _attention_rows_window_only(q, k, window)
    return _pool(probs[:, :, : t - window].sum(1), kernel, pooling)


def _shape(b: list[int], base: int, o: DynOptions, prior: list[int] | None) -> list[int]:
    mn = int(o.min_ratio * base)
    if mn > 0:
        raise_ = sum(max(0, mn - x) for x in b)
        over = sum(max(0, x - mn) for x in b)
        b = [max(x, mn) - (min(max(0, x - mn), raise_ * max(0, x - mn) // over) if over else 0) for x in b]
    if prior is not None:
        b = [int(o.prior_weight * x + (1.0 - o.prior_weight) * p) for x, p in zip(b, prior)]
    return b


def dynamickv_variant(policy: RefPolicy, o: DynOptions, qs: list[torch.Tensor], ks: list[torch.Tensor]):
    """DynamicKV with the variant options: (kept per layer incl. window, kept[layer][kv_head]).

    The kept sets are followed as kvserve builds them, layer by layer: a layer is selected when seen
    with its budget then, and re-selected inside what it holds when an update shrinks it."""
    num_layers = len(ks)
    kv, t, _ = ks[0].shape
    h = qs[0].shape[0]
    g = h // kv
    w = policy.window
    base = policy.budget - w
    bs = min(policy.r_max * base, t - w)
    cap = t - w
    m = policy.update_interval
    prior = None
    if o.prior == "pyramid":
        prior = [max(0, x - w) for x in pyramid_budgets(t, base + w, w, policy.beta, num_layers)]
    budget = [bs] * num_layers
    ranked: list[torch.Tensor] = []   # per layer: the ranking rows [rows, cap]
    normed: list[torch.Tensor] = []
    held: list[list[set] | None] = [None] * num_layers
    kept_budget = [None] * num_layers

    def select(layer: int, b: int) -> None:
        rows = ranked[layer]
        if o.variant == "paper":
            sets = [set(_rank(r)[:b]) for r in rows.tolist()]
        else:
            tops = [set(_rank(r)[:b]) for r in rows.tolist()]
            unions = [set().union(*tops[j * g:(j + 1) * g]) for j in range(kv)]
            width = max(len(u) for u in unions)
            mean = rows.view(kv, g, cap).mean(1).tolist()
            sets = []
            for j in range(kv):
                allowed = range(cap) if held[layer] is None else held[layer][j]
                rest = sorted((p for p in allowed if p not in unions[j]), key=lambda p: (-mean[j][p], p))
                sets.append(unions[j] | set(rest[: width - len(unions[j])]))
        held[layer] = sets
        kept_budget[layer] = b

    def update(n: int) -> None:
        rows = normed[0].shape[0]
        flat = torch.cat([s.reshape(-1) for s in normed[:n]])
        order = torch.sort(flat, descending=True, stable=True).indices[: base * rows * n]
        hits = torch.bincount(order // (rows * cap), minlength=n).tolist()
        new = _rebudget(hits, bs, base, num_layers, cap, budget[:n])
        if o.min_ratio > 0 or prior is not None:
            new = [max(0, min(x, cap, cur)) for x, cur in zip(_shape(new, base, o, prior), budget[:n])]
        budget[:n] = new
        for i in range(n):
            if budget[i] < kept_budget[i]:
                select(i, budget[i])

    for layer in range(num_layers):
        if o.variant == "paper":
            s = window_scores(qs[layer], ks[layer], w, policy.kernel, policy.pooling, "mean")
        else:
            s = _head_scores(qs[layer], ks[layer], w, policy.kernel, policy.pooling)
        ranked.append(s)
        if o.normalize == "kth":
            k = min(max(1, int(o.norm_rank * base)), cap)
            s = s / torch.topk(s, k, -1).values[:, k - 1:].clamp_min(1e-30)
        elif o.normalize != "none":
            raise ValueError(o.normalize)
        normed.append(s)
        select(layer, budget[layer])
        if (layer + 1) % m == 0:
            update(layer + 1)
    if num_layers % m != 0 and o.variant == "paper":
        update(num_layers)
    kept = [[sorted(hs) + list(range(t - w, t)) for hs in held[layer]] for layer in range(num_layers)]
    return [len(k[0]) for k in kept], kept
