"""kvserve's policy budgets and kept positions against kvpress (kvpress semantics) and against the
independent reference in policy_reference.py (paper semantics).

Runs `kvserve policy budgets|select` (set KVSERVE_BIN, or build the `kvserve` target). Positions
whose scores tie within 1e-6 relative with the selection boundary may legitimately swap (kvpress's
torch.topk has no defined tie order and float summation orders differ); every such swap is counted
and reported, any other difference fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_reference as ref  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TIE_RTOL = 1e-6


def _find_binary() -> str | None:
    env = os.environ.get("KVSERVE_BIN")
    if env:
        return env
    for cand in (REPO / "build" / "kvserve", REPO / "build-pol" / "kvserve"):
        if cand.exists():
            return str(cand)
    return None


BIN = _find_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="kvserve binary not built (set KVSERVE_BIN)")


def run_budgets(policy: str, prompt_len: int, layers: int, **params) -> list[int]:
    cmd = [BIN, "policy", "budgets", "--policy", policy, "--prompt-len", str(prompt_len), "--layers", str(layers)]
    for key, value in params.items():
        cmd += ["--param", f"{key}={value}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["budgets"]


def run_select(tmp_path: Path, policy: str, qs, ks, **params) -> dict:
    tensors = {}
    for layer, (q, k) in enumerate(zip(qs, ks)):
        if q is not None:
            tensors[f"q.{layer}"] = q.contiguous()
        tensors[f"k.{layer}"] = k.contiguous()
    qk = tmp_path / "qk.safetensors"
    out = tmp_path / "kept.json"
    save_file(tensors, str(qk))
    cmd = [BIN, "policy", "select", "--policy", policy, "--qk", str(qk), "--out", str(out)]
    for key, value in params.items():
        cmd += ["--param", f"{key}={value}"]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.read_text())


def random_qk(layers: int, h: int, kv: int, t: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # A few "heavy" keys make attention peaky, like real models, instead of uniform noise.
    qs, ks = [], []
    for _ in range(layers):
        q = torch.randn(h, t, d, generator=g)
        k = torch.randn(kv, t, d, generator=g)
        heavy = torch.randint(0, t, (t // 20,), generator=g)
        k[:, heavy] *= 3.0
        qs.append(q)
        ks.append(k)
    return qs, ks


# ----------------------------------------------------------------------------- kvpress fakes


class FakeAttention(torch.nn.Module):
    """The attributes kvpress presses read from a Llama attention layer; q_proj is the identity so
    that hidden_states carry the (already rotated) queries, and RoPE is the identity (cos 1, sin 0)."""

    def __init__(self, h: int, kv: int, d: int, layers: int, layer_idx: int):
        super().__init__()
        self.q_proj = torch.nn.Identity()
        self.config = SimpleNamespace(num_attention_heads=h, num_key_value_heads=kv, num_hidden_layers=layers)
        self.head_dim = d
        self.layer_idx = layer_idx


def kvpress_select(press, q, k, layer: int, layers: int):
    """(kept positions per KV head, scores [KV, T]) of a kvpress press on one layer."""
    h, t, d = q.shape
    kv = k.shape[0]
    module = FakeAttention(h, kv, d, layers, layer)
    hidden = q.transpose(0, 1).reshape(1, t, h * d)
    keys = k[None]
    # Values carry their own position so that the pruned values say which positions were kept.
    values = torch.arange(t, dtype=torch.float32).view(1, 1, t, 1).expand(1, kv, t, d).contiguous()
    kwargs = {"position_embeddings": (torch.ones(1, t, d), torch.zeros(1, t, d))}
    with torch.no_grad():
        _, kept_values = press.compress(module, hidden, keys, values, None, kwargs)
        scores = press.score(module, hidden, keys, values, None, kwargs)[0]
    kept = [sorted(int(x) for x in kept_values[0, head, :, 0].tolist()) for head in range(kv)]
    return kept, scores


def compare_layers(got_layers, want_layers, scores_per_layer, what: str) -> int:
    swaps = 0
    for layer, (got, want) in enumerate(zip(got_layers, want_layers)):
        for head, (g, w) in enumerate(zip(got, want)):
            s = None if scores_per_layer is None else scores_per_layer[layer][head]
            try:
                swaps += ref.compare_kept(g, w, s, TIE_RTOL)
            except AssertionError as e:
                raise AssertionError(f"{what}: layer {layer} head {head}: {e}") from None
    if swaps:
        print(f"{what}: {swaps} position(s) swapped between scores tied within {TIE_RTOL} relative")
    return swaps


def padded_scores(scores: torch.Tensor, t: int) -> list[list[float]]:
    """Prefix scores [KV, n] padded with +inf for the always-kept window (index = position)."""
    full = torch.full((scores.shape[0], t), float("inf"))
    full[:, : scores.shape[1]] = scores
    return full.tolist()


# ----------------------------------------------------------------------------- budgets


PYRAMID_PAPER_CASES = [
    # prompt, budget, layers, beta, window
    (1000, 128, 32, 20, 8),
    (240, 128, 32, 20, 8),   # clamp: max >= prompt - window
    (200, 128, 32, 20, 8),   # prompt < 2A: uniform
    (128, 128, 32, 20, 8),   # prompt <= budget: whole
    (64, 128, 32, 20, 8),
    (1000, 128, 1, 20, 8),   # one layer
    (5000, 64, 2, 20, 8),
    (4096, 128, 12, 20, 8),
    (16384, 128, 80, 20, 8),
    (3000, 256, 28, 5, 16),
    (777, 100, 7, 3, 4),
    (300, 40, 4, 1, 8),
]


@pytest.mark.parametrize("prompt,budget,layers,beta,window", PYRAMID_PAPER_CASES)
def test_pyramid_budgets_paper(prompt, budget, layers, beta, window):
    got = run_budgets("pyramidkv", prompt, layers, budget=budget, beta=beta, window=window)
    assert got == ref.pyramid_budgets(prompt, budget, window, beta, layers)
    if prompt <= budget:
        assert got == [prompt] * layers
    elif prompt < 2 * (budget - window):
        assert got == [budget] * layers
    else:
        assert abs(sum(got) - budget * layers) <= layers * (layers - 1) // 2 + layers


PYRAMID_KVPRESS_CASES = [
    # prompt, kept ratio, window, layers, beta
    (1000, 0.2, 8, 4, 20),
    (1000, 0.5, 64, 32, 20),
    (4096, 0.1, 64, 32, 20),
    (333, 0.3, 8, 12, 20),
    (100, 0.5, 64, 4, 20),   # falls back to uniform
    (1000, 0.7, 8, 16, 20),  # clamp to prompt - window
    (2048, 0.05, 16, 1, 20),
    (517, 0.25, 8, 28, 7),
]


@pytest.mark.parametrize("prompt,ratio,window,layers,beta", PYRAMID_KVPRESS_CASES)
def test_pyramid_budgets_kvpress(prompt, ratio, window, layers, beta):
    from kvpress import PyramidKVPress

    press = PyramidKVPress(compression_ratio=1.0 - ratio, window_size=window, beta=beta)
    want = [press.get_layer_budget(FakeAttention(1, 1, 1, layers, layer), prompt) for layer in range(layers)]
    got = run_budgets("pyramidkv", prompt, layers, budget_ratio=ratio, window=window, beta=beta, semantics="kvpress")
    assert got == want


def test_pyramid_semantics_differ_pinned():
    """Same average budget, different arithmetic: the authors add the window on top of a floored
    arithmetic sequence; kvpress counts it inside, uses float steps and round()."""
    paper = run_budgets("pyramidkv", 1000, 8, budget=208)
    kvp = run_budgets("pyramidkv", 1000, 8, budget_ratio=0.2, semantics="kvpress")
    assert paper == ref.pyramid_budgets(1000, 208, 8, 20, 8) == [398, 344, 290, 236, 182, 128, 74, 20]
    assert kvp == [390, 336, 281, 227, 173, 119, 64, 10]
    assert kvp != paper
    assert sum(kvp) == 8 * 200  # kvpress's own invariant: mean budget == prompt * (1 - compression_ratio)


def test_budgets_bad_param_is_a_clear_error():
    cmd = [BIN, "policy", "budgets", "--policy", "pyramidkv", "--prompt-len", "100", "--layers", "2",
           "--param", "windw=8"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode != 0
    assert "windw" in res.stderr and "valid keys" in res.stderr


# ----------------------------------------------------------------------------- select vs kvpress

H, KV, T, D, L = 8, 2, 320, 32, 4


@pytest.fixture(scope="module")
def qk():
    return random_qk(L, H, KV, T, D, seed=1234)


@pytest.mark.parametrize("ratio,window,kernel", [(0.25, 8, 5), (0.1, 16, 7), (0.5, 4, 3)])
def test_snapkv_matches_kvpress(tmp_path, qk, ratio, window, kernel):
    from kvpress import SnapKVPress

    qs, ks = qk
    got = run_select(tmp_path, "snapkv", qs, ks, budget_ratio=ratio, window=window, kernel=kernel, pooling="avg",
                     semantics="kvpress")
    press = SnapKVPress(compression_ratio=1.0 - ratio, window_size=window, kernel_size=kernel)
    want, scores = zip(*(kvpress_select(press, qs[l], ks[l], l, L) for l in range(L)))
    compare_layers([x["kept"] for x in got["layers"]], want, [s.tolist() for s in scores], "snapkv/kvpress")
    assert got["budgets"] == [len(w[0]) for w in want]


@pytest.mark.parametrize("ratio,window,beta", [(0.2, 8, 20), (0.3, 16, 5), (0.05, 8, 20)])
def test_pyramidkv_matches_kvpress(tmp_path, qk, ratio, window, beta):
    from kvpress import PyramidKVPress

    qs, ks = qk
    got = run_select(tmp_path, "pyramidkv", qs, ks, budget_ratio=ratio, window=window, kernel=5, pooling="avg",
                     beta=beta, semantics="kvpress")
    press = PyramidKVPress(compression_ratio=1.0 - ratio, window_size=window, kernel_size=5, beta=beta)
    want, scores = zip(*(kvpress_select(press, qs[l], ks[l], l, L) for l in range(L)))
    compare_layers([x["kept"] for x in got["layers"]], want, [s.tolist() for s in scores], "pyramidkv/kvpress")
    assert got["budgets"] == [len(w[0]) for w in want]


@pytest.mark.parametrize("ratio", [0.5, 0.23])
def test_knorm_matches_kvpress(tmp_path, qk, ratio):
    from kvpress import KnormPress

    _, ks = qk
    got = run_select(tmp_path, "knorm", [None] * L, ks, budget_ratio=ratio, semantics="kvpress")
    press = KnormPress(compression_ratio=1.0 - ratio)
    want, scores = zip(*(kvpress_select(press, torch.zeros(H, T, D), ks[l], l, L) for l in range(L)))
    compare_layers([x["kept"] for x in got["layers"]], want, [s.tolist() for s in scores], "knorm/kvpress")


def test_knorm_paper_skips_first_layers_kvpress_does_not(tmp_path, qk):
    """Pinned difference: the paper leaves layers 0 and 1 whole, kvpress compresses every layer."""
    _, ks = qk
    paper = run_select(tmp_path, "knorm", [None] * L, ks, budget_ratio=0.5)
    kvp = run_select(tmp_path, "knorm", [None] * L, ks, budget_ratio=0.5, semantics="kvpress")
    assert paper["budgets"] == [T, T, T // 2, T // 2]
    assert kvp["budgets"] == [T // 2] * L
    assert paper["layers"][2] == kvp["layers"][2]
    want = ref.select_layers(ref.RefPolicy("knorm", budget=T // 2, window=0, skip_layers=[0, 1]), [None] * L, ks)
    scores = [ref.key_norm_scores(k).tolist() for k in ks]
    compare_layers([x["kept"] for x in paper["layers"]], want[1], scores, "knorm/paper")


@pytest.mark.parametrize("ratio,sink", [(0.25, 4), (0.5, 1)])
def test_streamingllm_matches_kvpress_and_paper(tmp_path, qk, ratio, sink):
    from kvpress import StreamingLLMPress

    _, ks = qk
    got = run_select(tmp_path, "streamingllm", [None] * L, ks, budget_ratio=ratio, sink=sink, semantics="kvpress")
    press = StreamingLLMPress(compression_ratio=1.0 - ratio, n_sink=sink)
    want, _ = zip(*(kvpress_select(press, torch.zeros(H, T, D), ks[l], l, L) for l in range(L)))
    assert [x["kept"] for x in got["layers"]] == [list(w) for w in want]
    paper = run_select(tmp_path, "streamingllm", [None] * L, ks, budget=len(want[0][0]), sink=sink)
    assert [x["kept"] for x in paper["layers"]] == [list(w) for w in want]


# ----------------------------------------------------------------------------- select vs reference


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_paper_matches_reference(tmp_path, qk, pooling):
    qs, ks = qk
    got = run_select(tmp_path, "snapkv", qs, ks, budget=40, pooling=pooling)
    budgets, want = ref.select_layers(ref.RefPolicy("snapkv", budget=40, pooling=pooling), qs, ks)
    scores = [padded_scores(ref.window_scores(qs[l], ks[l], 8, 7, pooling, "sum"), T) for l in range(L)]
    compare_layers([x["kept"] for x in got["layers"]], want, scores, "snapkv/paper")
    assert got["budgets"] == budgets == [40] * L


def test_window_sum_and_mean_rank_alike(tmp_path, qk):
    """Pinned: the authors sum window scores, kvpress averages them; with the same kept counts the
    choice is the same up to float ties."""
    qs, ks = qk
    paper = run_select(tmp_path, "snapkv", qs, ks, budget=40, pooling="avg")
    kvp = run_select(tmp_path, "snapkv", qs, ks, budget=40, pooling="avg", semantics="kvpress")
    scores = [padded_scores(ref.window_scores(qs[l], ks[l], 8, 7, "avg", "sum"), T) for l in range(L)]
    compare_layers([x["kept"] for x in kvp["layers"]], [x["kept"] for x in paper["layers"]], scores, "sum-vs-mean")


@pytest.mark.parametrize("budget,layers", [(40, 4), (24, 6), (64, 3)])
def test_pyramidkv_paper_matches_reference(tmp_path, budget, layers):
    qs, ks = random_qk(layers, H, KV, T, D, seed=77 + layers)
    got = run_select(tmp_path, "pyramidkv", qs, ks, budget=budget)
    budgets, want = ref.select_layers(ref.RefPolicy("pyramidkv", budget=budget), qs, ks)
    scores = [padded_scores(ref.window_scores(qs[l], ks[l], 8, 7, "max", "sum"), T) for l in range(layers)]
    compare_layers([x["kept"] for x in got["layers"]], want, scores, "pyramidkv/paper")
    assert got["budgets"] == budgets


@pytest.mark.parametrize(
    "budget,r_max,m,layers,pooling",
    [(24, 5, 4, 8, "avg"), (24, 5, 4, 6, "avg"), (40, 10, 2, 5, "max"), (16, 3, 3, 7, "avg"), (24, 5, 4, 1, "avg")],
)
def test_dynamickv_matches_reference(tmp_path, budget, r_max, m, layers, pooling):
    qs, ks = random_qk(layers, H, KV, T, D, seed=500 + layers)
    got = run_select(tmp_path, "dynamickv", qs, ks, budget=budget, r_max=r_max, m=m, pooling=pooling,
                     variant="paper")
    policy = ref.RefPolicy("dynamickv", budget=budget, r_max=r_max, update_interval=m, pooling=pooling)
    budgets, want = ref.dynamickv(policy, qs, ks)
    assert got["budgets"] == budgets
    assert sum(budgets) <= budget * layers
    scores = [padded_scores(ref.window_scores(qs[l], ks[l], 8, 7, pooling, "mean"), T) for l in range(layers)]
    compare_layers([x["kept"] for x in got["layers"]], want, scores, "dynamickv/paper")


def test_h2o_paper_matches_reference(tmp_path):
    t = 96
    qs, ks = random_qk(2, 4, 2, t, 16, seed=9)
    got = run_select(tmp_path, "h2o", qs, ks, budget=24)
    budgets, want = ref.select_layers(ref.RefPolicy("h2o", budget=24), qs, ks)
    scores = [padded_scores(ref.accumulated_scores(qs[l], ks[l])[:, : t - 8], t) for l in range(2)]
    compare_layers([x["kept"] for x in got["layers"]], want, scores, "h2o/paper")
    assert got["budgets"] == budgets


def test_prompt_within_budget_is_kept_whole(tmp_path):
    qs, ks = random_qk(3, 4, 2, 50, 8, seed=3)
    for policy in ("snapkv", "pyramidkv", "dynamickv", "h2o", "streamingllm"):
        got = run_select(tmp_path, policy, qs, ks, budget=64)
        assert got["budgets"] == [50, 50, 50], policy
        for layer in got["layers"]:
            assert layer["kept"] == [list(range(50))] * 2, policy


@pytest.mark.parametrize(
    "params,layers",
    [
        (dict(variant="authors"), 6),                                   # the authors' code: unions, trailing bs
        (dict(variant="authors", m=2), 5),
        (dict(), 6),                                                    # the named default
        (dict(normalize="kth", norm_rank=0.5), 6),
        (dict(variant="paper", normalize="kth", norm_rank=0.25, min_ratio=0.5), 7),
        (dict(variant="paper", prior="pyramid", prior_weight=0.3), 6),
    ],
)
def test_dynamickv_variants_match_reference(tmp_path, params, layers):
    """Each DynamicKV variant's budgets and kept sets equal policy_reference.dynamickv_variant's."""
    qs, ks = random_qk(layers, H, KV, T, D, seed=900 + layers)
    m = params.get("m", 4)
    got = run_select(tmp_path, "dynamickv", qs, ks, budget=24, r_max=5, pooling="avg", **params)
    opts = {k: v for k, v in params.items() if k != "m"}
    if "variant" not in opts:  # the named default's options, as kvserve reports them
        pol = got["policy"]
        opts = {**{k: pol[k] for k in ("variant", "normalize", "norm_rank", "min_ratio", "prior", "prior_weight")},
                **opts}
    want_budgets, want = ref.dynamickv_variant(ref.RefPolicy("dynamickv", budget=24, r_max=5, pooling="avg",
                                                             update_interval=m), ref.DynOptions(**opts), qs, ks)
    assert got["budgets"] == want_budgets
    assert [x["kept"] for x in got["layers"]] == want
    if params.get("variant") == "authors":
        assert sum(want_budgets) > 24 * layers  # the unions cost more than the budget: charged honestly
