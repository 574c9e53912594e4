"""A precision per policy (issue 47): policies that name a `kv_dtype` of their own (or a ladder of
them), served from one YAML config by `kvserve serve`. Each policy's request answers, token for token and logprob for
logprob, what a server whose whole cache has that dtype answers; a `budget_bytes` keeps more tokens
at fewer bits; a dtype the model cannot store stops the server naming the policy; the one-shot tools
refuse such a policy."""
from __future__ import annotations

import pathlib
import subprocess
import tempfile

import pytest

from kvserve_server import Server, complete_ids, kvserve_bin, model_dir

PROMPT = "The river carried the boats past the mill, the bridge and the old tower, then on to the sea. " * 6


def config(tmp: pathlib.Path, kv_cache_dtype: str, policies: str) -> pathlib.Path:
    cfg = tmp / f"{kv_cache_dtype}.yaml"
    cfg.write_text(f"""model:
  path: {model_dir()}
  served_model_name: tiny
  device: cpu
server:
  host: 127.0.0.1
  port: 0
  threads: 2
cache:
  block_size: 16
  kv_cache_bytes: 32MiB
  kv_cache_dtype: {kv_cache_dtype}
policies:
  full: {{}}
{policies}""")
    return cfg


MIXED = """  full8:
    method: full
    kv_dtype: int8
  snap4:
    method: snapkv
    budget: 32
    window: 4
    kv_dtype: int4
  snap32b:
    method: snapkv
    budget_bytes: 24KiB
    window: 4
  snap4b:
    method: snapkv
    budget_bytes: 24KiB
    window: 4
    kv_dtype: int4
  lad:
    method: snapkv
    budget_bytes: 24KiB
    window: 4
    kv_dtype: ladder
"""


def ask(srv, policy: str) -> tuple[list[int], list[float], dict]:
    r = complete_ids(srv, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "kv_policy": policy})
    c = r["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], r["usage"]


@pytest.fixture(scope="module")
def tmp():
    with tempfile.TemporaryDirectory(prefix="kvserve-kvdtype-") as d:
        yield pathlib.Path(d)


def test_each_policy_answers_as_a_cache_of_its_dtype(tmp):
    mixed = Server(config=config(tmp, "float32", MIXED))
    try:
        got = {p: ask(mixed, p) for p in ("full", "full8", "snap4", "snap32b", "snap4b", "lad")}
        idle = mixed.wait_idle()
        assert idle["kvserve:kv_cache_bytes_used"] == 0, idle
        for dtype in ("float32", "int8", "int4"):  # every format's bytes, none held now
            assert idle[f'kvserve:kv_cache_bytes_used_by_dtype{{model_name="tiny",kv_dtype="{dtype}"}}'] == 0, idle
    finally:
        mixed.close()
    want = {}
    for dtype, policies, names in (("float32", "", ("full",)), ("int8", "", ("full",)),
                                   ("int4", "  snap:\n    method: snapkv\n    budget: 32\n    window: 4\n"
                                            "  snapb:\n    method: snapkv\n    budget_bytes: 24KiB\n    window: 4\n",
                                    ("snap", "snapb"))):
        s = Server(config=config(tmp, dtype, policies))
        try:
            for n in names:
                want[(dtype, n)] = ask(s, n)
        finally:
            s.close()
    # One request at a time in every server: the same arithmetic, so equal bit for bit.
    assert got["full"][:2] == want[("float32", "full")][:2]
    assert got["full8"][:2] == want[("int8", "full")][:2]
    assert got["snap4"][:2] == want[("int4", "snap")][:2]
    assert got["full8"][1] != got["full"][1]  # int8 is not float32: the comparison can tell them apart
    assert got["snap4"][2]["kv_kept_tokens"] == want[("int4", "snap")][2]["kv_kept_tokens"]
    # The same 24 KiB keeps 7x the tokens in int4 (72 bytes a token-layer) as in float32 (512).
    kept32, kept4 = got["snap32b"][2]["kv_kept_tokens"], got["snap4b"][2]["kv_kept_tokens"]
    assert kept4 == want[("int4", "snapb")][2]["kv_kept_tokens"]
    assert kept4 >= 6 * kept32 > 0, (kept32, kept4)
    # The ladder: 45 int8 tokens a layer are under half of this prompt, so it runs as int4 does.
    assert got["lad"][2]["kv_kept_tokens"] == kept4
    assert got["lad"][2]["kv_policy"] == "lad"
    # Each request says what its K/V were stored in: the policy's dtype, the ladder's rung.
    dtypes = {p: got[p][2]["kv_cache_dtype"] for p in ("full", "full8", "snap4", "snap32b", "snap4b", "lad")}
    assert dtypes == {"full": "float32", "full8": "int8", "snap4": "int4", "snap32b": "float32", "snap4b": "int4",
                      "lad": "int4"}, dtypes
    assert got["lad"][:2] == got["snap4b"][:2]


def test_a_dtype_the_model_cannot_store_names_the_policy(tmp):
    cfg = config(tmp, "auto", "  odd:\n    method: full\n    kv_dtype: int3\n")
    out = subprocess.run([kvserve_bin(), "serve", "--config", str(cfg), "--port", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "policy 'odd'" in out.stderr and "int3" in out.stderr, out.stderr


def test_one_shot_tools_refuse_a_policy_kv_dtype(tmp):
    ids = tmp / "ids.json"
    ids.write_text("[1, 2, 3, 4, 5, 6, 7, 8]")
    out = subprocess.run([kvserve_bin(), "forward", "--model", model_dir(), "--input-ids", str(ids), "--output",
                          str(tmp / "o.safetensors"), "--policy", "snapkv", "--budget", "16",
                          "--policy-param", "kv_dtype=int8"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "kv_dtype 'int8'" in out.stderr and "--kv-cache-dtype" in out.stderr, out.stderr
