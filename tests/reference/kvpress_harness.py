"""Pure helpers that run kvpress presses and the paper references on a Hugging Face fixture model.

- `full_cache` runs the model once without a press and returns every layer's post-RoPE keys and
  values (DynamicCache) plus the post-RoPE queries (forward hooks on the attention modules).
- `kvpress_kept` runs the model again under `with press(model)` and recovers, per (layer, KV head),
  which prompt positions the compressed cache kept by matching each kept key row to the original
  rows of that head (exact match expected: the same float computation runs twice). The press's own
  scores are recorded too, so that a caller can tell ties from real differences.
- `decode_with_kept` greedy-decodes from a cache pruned to given kept positions, with generated
  tokens at their true positions prompt_len + t (what kvserve must be equal to).

Nothing here imports kvserve: the comparison lives in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half


def load_model(path) -> transformers.PreTrainedModel:
    """fp32 on CPU, eval mode, SDPA attention (kvpress then recomputes its window attention)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _attention_modules(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


@dataclass
class FullRun:
    keys: list[torch.Tensor]     # per layer [KV, T, D] post-RoPE
    values: list[torch.Tensor]   # per layer [KV, T, D]
    queries: list[torch.Tensor]  # per layer [H, T, D] post-RoPE
    logits: torch.Tensor         # [T, vocab]


def full_cache(model, ids: list[int]) -> FullRun:
    """One uncompressed forward: post-RoPE keys/values from the cache, post-RoPE queries from hooks."""
    queries: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        b, t, _ = hidden.shape
        q = module.q_proj(hidden).view(b, t, -1, module.head_dim).transpose(1, 2)
        if getattr(module, "q_norm", None) is not None:  # Qwen3-style; not in the fixtures
            q = module.q_norm(q)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        queries[module.layer_idx] = q[0].detach().clone()

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _attention_modules(model)]
    try:
        cache = DynamicCache()
        with torch.no_grad():
            out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    n = len(cache.layers)
    return FullRun(
        keys=[cache.layers[l].keys[0].clone() for l in range(n)],
        values=[cache.layers[l].values[0].clone() for l in range(n)],
        queries=[queries[l] for l in range(n)],
        logits=out.logits[0].float(),
    )


@dataclass
class PressRun:
    kept: list[list[list[int]]]      # [layer][kv head] -> sorted kept positions
    scores: list[list[list[float]] | None]  # [layer][kv head][position] as the press scored them
    max_match_error: float           # largest distance between a kept row and its matched original


def match_rows(compressed: torch.Tensor, original: torch.Tensor) -> tuple[list[int], float]:
    """Positions of `compressed` rows [n, D] among `original` rows [T, D] (nearest match), and the
    largest distance of a match. Asserts that no original row is matched twice."""
    dist = torch.cdist(compressed.double(), original.double())
    best = dist.min(dim=1)
    pos = best.indices.tolist()
    assert len(set(pos)) == len(pos), "two kept keys matched the same original position"
    return sorted(pos), float(best.values.max()) if len(pos) else 0.0


def kvpress_kept(model, press, ids: list[int], full: FullRun) -> PressRun:
    """Kept positions per (layer, KV head) of `press` applied to `model` on `ids`."""
    recorded: dict[int, torch.Tensor] = {}
    original_score = press.score

    def recording_score(module, *args, **kwargs):
        s = original_score(module, *args, **kwargs)
        recorded[module.layer_idx] = s[0].detach().float().clone()
        return s

    press.score = recording_score  # instance attribute shadows the method while the press runs
    try:
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        del press.score
    kept, scores, err = [], [], 0.0
    for layer in range(len(cache.layers)):
        keys = cache.layers[layer].keys[0]
        heads = []
        for h in range(keys.shape[0]):
            pos, e = match_rows(keys[h], full.keys[layer][h])
            heads.append(pos)
            err = max(err, e)
        kept.append(heads)
        s = recorded.get(layer)
        scores.append(None if s is None else s.tolist())
    return PressRun(kept=kept, scores=scores, max_match_error=err)


def decode_with_kept(model, full: FullRun, kept: list[list[list[int]]], first_token: int, steps: int,
                     prompt_len: int) -> list[int]:
    """Greedy tokens from a cache holding, per (layer, KV head), only the `kept` prompt positions at
    their original RoPE positions; the t-th generated token sits at position prompt_len + t.
    `first_token` is the prefill's argmax (prefill attention is never compressed)."""
    cache = DynamicCache()
    for layer, heads in enumerate(kept):
        idx = torch.tensor(heads, dtype=torch.long)  # [KV, n]
        d = full.keys[layer].shape[-1]
        gidx = idx.unsqueeze(-1).expand(-1, -1, d)
        k = full.keys[layer].gather(1, gidx).unsqueeze(0).contiguous()
        v = full.values[layer].gather(1, gidx).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return _greedy(model, cache, first_token, steps, prompt_len)


def _greedy(model, cache, first_token: int, steps: int, prompt_len: int) -> list[int]:
    """`steps` greedy tokens from `cache`, the first given, the t-th new one at prompt_len + t."""
    tokens = [first_token]
    with torch.no_grad():
        for t in range(steps - 1):
            pos = torch.tensor([[prompt_len + t]])
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos,
                        cache_position=pos[0], use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def decode_with_masked(model, full: FullRun, kept: list[list[list[int]]], first_token: int, steps: int,
                       prompt_len: int) -> list[int]:
    """decode_with_kept for heads that keep different counts: the cache holds every prompt position
    and each attention module masks what its heads dropped through kvpress's attention patch
    (`masked_key_indices`, a fake key whose attention underflows to zero), as AdaKV decodes."""
    import kvpress  # noqa: F401  (installs the attention patch)

    cache = DynamicCache()
    for layer in range(len(kept)):
        cache.update(full.keys[layer].unsqueeze(0).contiguous(), full.values[layer].unsqueeze(0).contiguous(), layer)
    modules = _attention_modules(model)
    for module in modules:
        heads, positions = [], []
        for h, ps in enumerate(kept[module.layer_idx]):
            dropped = sorted(set(range(prompt_len)) - set(ps))
            heads += [h] * len(dropped)
            positions += dropped
        module.masked_key_indices = (torch.zeros(len(heads), dtype=torch.long), torch.tensor(heads, dtype=torch.long),
                                     torch.tensor(positions, dtype=torch.long)) if heads else None
    try:
        return _greedy(model, cache, first_token, steps, prompt_len)
    finally:
        for module in modules:
            module.masked_key_indices = None


def kvpress_masked_kept(model, press, ids: list[int]) -> PressRun:
    """Kept positions per (layer, KV head) of a press that masks instead of removing (AdaKVPress:
    its cache keeps every key and each attention module records the pruned (batch, head, position)
    triples in `masked_key_indices`, read by kvpress's attention patch at decode). Kept = the rest.
    The inner scorer's scores are recorded before AdaKV overwrites its safeguard entries."""
    recorded: dict[int, torch.Tensor] = {}
    inner = press.press
    original_score = inner.score

    def recording_score(module, *args, **kwargs):
        s = original_score(module, *args, **kwargs)
        recorded[module.layer_idx] = s[0].detach().float().clone()
        return s

    inner.score = recording_score
    try:
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        del inner.score
    kept, scores = [], []
    t = len(ids)
    for module in _attention_modules(model):
        kv_heads = cache.layers[module.layer_idx].keys.shape[1]
        mask = torch.ones(kv_heads, t, dtype=torch.bool)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            _, heads, positions = masked
            mask[heads, positions] = False
        kept.append([torch.nonzero(mask[h]).flatten().tolist() for h in range(kv_heads)])
        s = recorded.get(module.layer_idx)
        scores.append(None if s is None else s.tolist())
    return PressRun(kept=kept, scores=scores, max_match_error=0.0)


def kvpress_kvzip_kept(model, press, ids: list[int]) -> PressRun:
    """Kept positions per (layer, KV head) of kvpress's KVzipPress: after the prefill it runs its
    reconstruction passes and records, per attention module, the pruned (batch, head, position)
    triples in `masked_key_indices` (its cache keeps every key). Its score tensor is recorded after
    it gave the sinks their top score, as it selects from it."""
    recorded: dict[str, torch.Tensor] = {}
    original_post = press.compress_post

    def recording_post(m):
        original_post(m)
        recorded["scores"] = press.score_val.detach().float().clone()  # [L, 1, KV, T]

    press.compress_post = recording_post
    try:
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        del press.compress_post
    kept, scores = [], []
    t = len(ids)
    for module in _attention_modules(model):
        kv_heads = cache.layers[module.layer_idx].keys.shape[1]
        mask = torch.ones(kv_heads, t, dtype=torch.bool)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            _, heads, positions = masked
            mask[heads, positions] = False
        module.masked_key_indices = None  # what a later forward must not read
        kept.append([torch.nonzero(mask[h]).flatten().tolist() for h in range(kv_heads)])
        scores.append(recorded["scores"][module.layer_idx, 0].tolist() if recorded else None)
    return PressRun(kept=kept, scores=scores, max_match_error=0.0)
