"""kvserve's prefill KV selection re-done in PyTorch on a transformers model, for per-layer evidence
and for trying DynamicKV variants before (and beside) the C++.

For each prompt the full prompt is prefilled once (post-RoPE queries of the last `window` positions
and keys captured per layer); every policy's kept set per (layer, KV head) is computed from them;
the HF cache is cut to that set and the answer decoded greedily (position ids continue after the
prompt, as in kvserve). Written from the papers and docs/eval/dynamickv.md, not from kvserve's C++.

Policies: snapkv, pyramidkv (paper arithmetic, window scores summed, max pooling) and dynamickv
with variant options (see `dynamic_budgets`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent.parent / "tests" / "reference"))
from policy_reference import _rebudget as _reference_rebudget  # noqa: E402


# ----------------------------------------------------------------------------- capture


class Capture:
    """Hooks every attention layer to keep the last `window` post-RoPE queries and all keys."""

    def __init__(self, model, window: int):
        self.window, self.q, self.k = window, {}, {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i):
        def hook(mod, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            if h.shape[1] < self.window:  # decode steps
                return
            d = mod.head_dim
            q = mod.q_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)
            k = mod.k_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)

            def rot(x):
                x1, x2 = x[..., : d // 2], x[..., d // 2:]
                return torch.cat((-x2, x1), -1)

            q = q * c + rot(q) * s
            k = k * c + rot(k) * s
            self.q[i] = q[0, :, -self.window:].float()
            self.k[i] = k[0].float()
        return hook


def window_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[H, w, T] softmax attention of the window queries q [H, w, D] over keys k [KV, T, D]."""
    h, w, d = q.shape
    kv, t, _ = k.shape
    g = h // kv
    logits = torch.einsum("kgwd,ktd->kgwt", q.view(kv, g, w, d), k) / math.sqrt(d)
    mask = torch.ones(w, w, dtype=torch.bool).triu(1)
    logits[..., t - w:] = logits[..., t - w:].masked_fill(mask, float("-inf"))
    return torch.softmax(logits, -1).reshape(h, w, t)


def pool(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    if kernel <= 1:
        return x
    if pooling == "max":
        return F.max_pool1d(x.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
    return F.avg_pool1d(x.unsqueeze(1), kernel, 1, kernel // 2, count_include_pad=True).squeeze(1)


def head_scores(probs: torch.Tensor, window: int, kernel: int, pooling: str, reduce: str) -> torch.Tensor:
    """Per query head [H, T - w] pooled window scores."""
    pre = probs[..., : probs.shape[-1] - window]
    s = pre.sum(1) if reduce == "sum" else pre.mean(1)
    return pool(s, kernel, pooling)


# ----------------------------------------------------------------------------- budgets


def pyramid_budgets(t: int, budget: int, window: int, beta: int, L: int) -> list:
    a = max(budget - window, 0)
    if t < 2 * a or L == 1:
        return [a + window] * L
    lo = a // beta
    hi = 2 * a - lo
    if hi >= t - window:
        hi = t - window
        lo = 2 * a - hi
    steps = (hi - lo) // (L - 1)
    return [hi - i * steps + window for i in range(L)]


# Algorithm 1's Update_Buffer_Length, exactly as the independent reference computes it.
rebudget = _reference_rebudget


def normalise(s: torch.Tensor, how: str, kth: int = 1) -> torch.Tensor:
    """Scores [heads, N] made comparable across layers before the global top-k."""
    if how == "none":
        return s
    if how == "layer":   # each layer's scores sum to 1
        return s / s.sum().clamp_min(1e-30)
    if how == "head":    # each head's scores sum to 1
        return s / s.sum(-1, keepdim=True).clamp_min(1e-30)
    if how == "max":     # each head's best token scores 1
        return s / s.amax(-1, keepdim=True).clamp_min(1e-30)
    if how == "kth":     # each head's kth best token scores 1 (kth = base)
        return s / torch.topk(s, min(kth, s.shape[-1]), -1).values[..., -1:].clamp_min(1e-30)
    raise ValueError(how)


def dynamic_budgets(scores: list, base: int, bs: int, opts: dict) -> list:
    """Scored budgets per layer (window excluded). scores: per layer [rows, N] (the ranking rows).

    opts: m (update interval), final (extra update at the last layer), norm (see normalise),
    min_frac (per-layer minimum = min_frac * base, taken from the others in proportion), prior
    ('pyramid': mixed with PyramidKV's schedule, weight `alpha` on the dynamic budgets). The
    shaping runs inside every update, and budgets only shrink.
    """
    L = len(scores)
    rows, cap = scores[0].shape
    m = opts.get("m", 4)
    kth = max(1, int(opts.get("rank", 1.0) * base))
    normed = [normalise(s.reshape(-1, cap), opts.get("norm", "none"), kth) for s in scores]
    budget = [bs] * L
    prior = None
    if opts.get("prior") == "uniform":
        prior = [base] * L
    if opts.get("prior") == "pyramid":
        w = opts["window"]
        prior = [max(0, p - w) for p in pyramid_budgets(opts["t"], base + w, w, 20, L)]

    def update(n):
        flat = torch.cat([s.reshape(-1) for s in normed[:n]])
        idx = torch.sort(flat, descending=True, stable=True).indices[: base * rows * n]
        hits = torch.bincount(idx // (rows * cap), minlength=n).tolist()
        b = rebudget(hits, bs, base, L, cap, budget[:n])
        mn = int(opts.get("min_frac", 0.0) * base)
        if mn:
            b = with_minimum(b, mn)
        if prior is not None:
            a = opts.get("alpha", 0.5)
            b = [int(a * x + (1 - a) * p) for x, p in zip(b, prior)]
        budget[:n] = [max(0, min(x, cap, cur)) for x, cur in zip(b, budget[:n])]

    for layer in range(L):
        if (layer + 1) % m == 0:
            update(layer + 1)
    if opts.get("final", True) and L % m:
        update(L)
    return budget


def with_minimum(budget: list, mn: int) -> list:
    """Raises every layer to at least mn, taking the tokens from the layers above mn in proportion
    to their excess."""
    raise_ = sum(max(0, mn - b) for b in budget)
    over = sum(max(0, b - mn) for b in budget)
    out = []
    for b in budget:
        above = max(0, b - mn)
        out.append(max(b, mn) - (min(above, raise_ * above // over) if over else 0))
    return out


# ----------------------------------------------------------------------------- selection


def keep_top(scores: torch.Tensor, n: int, t: int, window: int) -> torch.Tensor:
    """[KV, n + window] kept positions: the n best of each row plus the window."""
    n = min(n, scores.shape[1])
    top = torch.topk(scores, n, -1).indices if n else scores.new_zeros(scores.shape[0], 0, dtype=torch.long)
    win = torch.arange(t - window, t).expand(scores.shape[0], window)
    return torch.sort(torch.cat([top, win], 1), 1).values


def select(policy: str, cap: Capture, t: int, budget: int, opts: dict | None = None):
    """Kept positions per layer [KV, n_l] and (for evidence) the per-layer scored budgets."""
    opts = dict(opts or {})
    L = len(cap.k)
    w = opts.get("window", 8)
    kv = cap.k[0].shape[0]
    if t <= budget:
        return [torch.arange(t).expand(kv, t) for _ in range(L)], [t] * L
    probs = [window_probs(cap.q[i][:, -w:], cap.k[i]) for i in range(L)]
    if policy in ("snapkv", "pyramidkv"):
        counts = pyramid_budgets(t, budget, w, 20, L) if policy == "pyramidkv" else [budget] * L
        kept = []
        for i in range(L):
            s = head_scores(probs[i], w, 7, "max", "sum")
            s = s.view(kv, -1, s.shape[-1]).mean(1)
            kept.append(keep_top(s, counts[i] - w, t, w))
        return kept, [c - w for c in counts]
    assert policy == "dynamickv", policy
    base = budget - w
    bs = min(opts.get("r_max", 10) * base, t - w)
    pooling, kernel = opts.get("pooling", "avg"), opts.get("kernel", 7)
    hs = [head_scores(p, w, kernel, pooling, "mean") for p in probs]  # [H, N]
    per_q = opts.get("per_query_head", False)
    kv_scores = [s.view(kv, -1, s.shape[-1]).mean(1) for s in hs]
    units = hs if per_q else kv_scores
    opts.update(t=t, window=w)
    b = dynamic_budgets(units, base, bs, opts)
    if opts.get("authors_trailing", False):  # the last L mod m layers never re-budgeted: keep bs
        m = opts.get("m", 4)
        for i in range(L - L % m, L):
            b[i] = bs
    kept = []
    for i in range(L):
        if per_q:  # each query head's top b_i, the union stored per KV head
            top = torch.topk(hs[i], min(b[i], hs[i].shape[1]), -1).indices.view(kv, -1)
            sets = [torch.unique(row) for row in top]
            n = max(len(x) for x in sets)
            rows = []
            for h, x in enumerate(sets):  # pad the smaller unions with the head's next best (honest: charged)
                if len(x) < n:
                    order = torch.argsort(kv_scores[i][h], descending=True)
                    extra = order[~torch.isin(order, x)][: n - len(x)]
                    x = torch.cat([x, extra])
                rows.append(x)
            top = torch.stack(rows)
            win = torch.arange(t - w, t).expand(kv, w)
            kept.append(torch.sort(torch.cat([top, win], 1), 1).values)
        else:
            kept.append(keep_top(kv_scores[i], b[i], t, w))
    return kept, [k.shape[1] - w for k in kept]


# ----------------------------------------------------------------------------- decode


@torch.no_grad()
def prefill(model, ids: list, window: int):
    cap = Capture(model, window)
    x = torch.tensor([ids])
    out = model(x, use_cache=True)
    for h in cap.handles:
        h.remove()
    return cap, out.past_key_values, out.logits[0, -1]


@torch.no_grad()
def decode(model, cache, first_logits, kept: list | None, t: int, max_tokens: int, eos: set) -> list:
    """Greedy decode on a copy of the prefill cache cut to `kept` ([KV, n] per layer)."""
    import copy
    c = copy.copy(cache)
    c.layers = [copy.copy(l) for l in cache.layers]
    if kept is not None:
        for i, l in enumerate(c.layers):
            idx = kept[i].unsqueeze(0).unsqueeze(-1).expand(1, -1, -1, l.keys.shape[-1])
            l.keys = torch.gather(l.keys, 2, idx)
            l.values = torch.gather(l.values, 2, idx)
    out = []
    tok = int(first_logits.argmax())
    for step in range(max_tokens):
        out.append(tok)
        if tok in eos:
            break
        n = c.layers[0].keys.shape[2]
        pos = torch.tensor([[t + step]])
        logits = model(torch.tensor([[tok]]), past_key_values=c, position_ids=pos, use_cache=True,
                       attention_mask=torch.ones(1, n + 1, dtype=torch.long)).logits[0, -1]
        tok = int(logits.argmax())
    return out


def evidence(cap: Capture, kept: list, needle: list, t: int, window: int) -> list:
    """Per layer: (kept count per head, attention mass of the window queries on the kept prefix
    positions as a fraction of their mass on the whole prefix, fraction of needle tokens kept)."""
    rows = []
    for i, kp in enumerate(kept):
        p = window_probs(cap.q[i][:, -window:], cap.k[i])  # [H, w, T]
        kv = kp.shape[0]
        g = p.shape[0] // kv
        pre = p[..., : t - window].sum(1)  # [H, N]
        mass_all = pre.sum().item()
        mask = torch.zeros(kv, t, dtype=torch.bool)
        mask.scatter_(1, kp, True)
        m = mask[:, : t - window].repeat_interleave(g, 0)
        mass = (pre * m).sum().item() / max(mass_all, 1e-30)
        nd = mask[:, needle].float().mean().item() if needle else float("nan")
        rows.append((kp.shape[1], mass, nd))
    return rows
