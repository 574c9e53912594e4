"""kvserve's tokenizer against Hugging Face `tokenizers`, token for token, on the fixture tokenizers
and on the default model's (SmolLM2-135M-Instruct, converted by tools/make_smollm2.py).

Runs `$KVSERVE_BIN tokenize/detokenize` on >= 5,000 generated lines per tokenizer (English, CJK,
Arabic, emoji with ZWJ and skin tones, code, whitespace runs, control characters, digit runs,
special-token look-alikes) and compares with `tokenizers.Tokenizer.from_file(...)`.
Fixtures come from $KVSERVE_FIXTURES/tokenizers, or are trained into a temporary folder.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import unicodedata

import pytest

from kvserve_testlib import default_model_dir

tokenizers = pytest.importorskip("tokenizers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE_NAMES = ["bytelevel", "metaspace", "metaspace_pt", "qwen2"]
# The default model's tokenizer (SmolLM2: digits split one by one, then GPT-2 byte-level BPE) gets the
# full corpus too.
NAMES = FIXTURE_NAMES + ["smollm2"]
VARIANTS = ["gpt2_variant", "llama2_variant", "metaspace_always_0", "metaspace_never_1", "metaspace_first_0",
            "metaspace_legacy", "split_variant"]
N_LINES = 5200

# --------------------------------------------------------------------------------------------
# Deterministic test text.

_EN = ("The quick brown fox jumps over the lazy dog. It's what we'd've done; they'RE here, I'M sure, "
       "you'll SEE. Don't stop — \"quoted\" (parens) [brackets] {braces} <angle> e.g. i.e. U.S.A. "
       "naïve café résumé Ångström ﬁnance").split(" ")
_CJK = ["数据模型", "注意力机制", "东京都", "日本語のテキスト", "こんにちは世界", "カタカナ", "한국어 텍스트",
        "안녕하세요", "漢字かな交じり文", "中文，标点。", "「括弧」", "ｆｕｌｌｗｉｄｔｈ", "〇一二三"]
_ARABIC = ["مرحبا بالعالم", "اللغة العربية", "السَّلَامُ عَلَيْكُمْ", "١٢٣٤٥", "كتاب‎", "שלום עולם",
           "नमस्ते दुनिया", "สวัสดีครับ", "Привет, мир!", "Γειά σου κόσμε", "Straße", "ǅemal"]
_EMOJI = ["😀", "👍🏽", "👍🏿", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🤖", "🇯🇵", "🇩🇪", "✨", "1️⃣", "👩🏻‍💻",
          "🧑‍🤝‍🧑", "👁️‍🗨️", "🫠", "☕", "✊🏾", "🏴‍☠️"]
_CODE = ["def f(x):", "    return x + 1", "for (int i = 0; i < n; ++i) { s += a[i]; }",
         "if x != None and y >= 3: print(f'{x!r}')", "#include <vector>", "SELECT * FROM t WHERE id = 42;",
         "let v: Vec<u8> = vec![0x1f, 0xff];", "\tindent\t\t  mixed", "a->b ?? c ?: d", "x<<=2; y>>>=1;",
         "/* comment */ // line", "$HOME/.config/~user", "https://example.com/a?b=c&d=e#f", "{\"k\": [1, 2.5e-3]}"]
_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<s>", "</s>", "<unk>", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>", "<tool_call>", "<0x41>", "<0xZZ>", "<|eot", "<s", "< s>", "<|start_header_id|>"]
_CONTROL = ["\x00", "\x01", "\x07", "\x08", "\x0b", "\x0c", "\r", "\x1b", "\x1c", "\x1f", "\x7f", "\x85",
            "\u200b", "\u200c", "\u200d", "\u200e", "\ufeff", "\u2028", "\u2029", "\u00ad", "\ufffd", "\ue000"]
_SPACES = [" ", "\t", "\u00a0", "\u3000", "\u2003", "\u1680", "\u202f"]
# Combining sequences that NFC changes (the qwen2 fixture normalizes with NFC).
_COMBINING = ["e\u0301", "A\u030a", "o\u0308\u0304", "\u1100\u1161\u11a8", "\u0915\u093c", "Å", "Ω",
              "\u0644\u0653", "q\u0307\u0323", "\u1e0b\u0323", "\u00c5\u0301", "\u3099ka\u3099", "ｶﾞ"]


def _random_char(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF), (0x1100, 0x11FF),
              (0x1E00, 0x1FFF), (0x2000, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0xF900, 0xFFFD), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0x10000, 0x1034F)]
    while True:
        lo, hi = rng.choice(ranges)
        c = chr(rng.randint(lo, hi))
        if c != "\n" and unicodedata.category(c) not in ("Cn", "Cs"):
            return c


def _segment(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.25:
        words = [rng.choice(_EN) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.2:
            words = [w.upper() for w in words]
        return " ".join(words)
    if k < 0.35:
        return rng.choice(" ").join(rng.choice(_CJK) for _ in range(rng.randint(1, 4)))
    if k < 0.43:
        return " ".join(rng.choice(_ARABIC) for _ in range(rng.randint(1, 3)))
    if k < 0.51:
        return rng.choice(["", " "]).join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 6)))
    if k < 0.59:
        return rng.choice(_CODE)
    if k < 0.66:
        return "".join(rng.choice(_SPACES) for _ in range(rng.randint(1, 40 if rng.random() < 0.3 else 4)))
    if k < 0.72:
        return "".join(rng.choice(_CONTROL) for _ in range(rng.randint(1, 4)))
    if k < 0.79:
        n = rng.randint(1, 40)
        return "".join(rng.choice("0123456789") for _ in range(n)) + rng.choice(["", ".5", ",000", "%", "٣"])
    if k < 0.86:
        return rng.choice(_SPECIAL)
    if k < 0.91:
        return rng.choice(_COMBINING)
    return "".join(_random_char(rng) for _ in range(rng.randint(1, 12)))


def make_lines(seed: int = 1234, n: int = N_LINES) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        parts = [_segment(rng) for _ in range(rng.randint(1, 6))]
        line = "".join(p + rng.choice(["", " ", " ", "  ", "\t", ""]) for p in parts)
        if i % 97 == 0:
            line = ""
        elif i % 89 == 0:
            line = " " * rng.randint(1, 300)
        elif i % 83 == 0:
            line = line * rng.randint(20, 60)  # long lines: long words and long whitespace runs
        lines.append(line.replace("\n", " "))
    return lines


def make_multiline_texts(seed: int = 99, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    seps = ["\n", "\n\n", "\r\n", " \n", "\n  ", "\t\n", "\n\n\n    ", "\n<|eot_id|>\n", "\n</s>"]
    return ["".join(_segment(rng) + rng.choice(seps) for _ in range(rng.randint(1, 6))) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Fixtures.

def _added(data, content, **kw):
    ids = [t["id"] for t in data["added_tokens"]] + list(data["model"]["vocab"].values())
    tok = {"id": max(ids) + 1, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": False}
    tok.update(kw)
    data["added_tokens"].append(tok)

def _flags(data, content, **kw):
    for t in data["added_tokens"]:
        if t["content"] == content:
            t.update(kw)

def make_variants(base: dict[str, pathlib.Path], out: pathlib.Path) -> dict[str, pathlib.Path]:
    """Edited copies of the fixtures covering options the trained ones do not use (added-token
    lstrip/rstrip/single_word/normalized, GPT-2 ByteLevel with prefix space, Metaspace schemes,
    legacy Metaspace, Strip/NFC normalizers, Digits and every Split behavior)."""
    out = pathlib.Path(out)
    res = {}
    def load(name):
        return json.loads((base[name] / "tokenizer.json").read_text(encoding="utf-8"))
    def save(name, data, src):
        d = out / name; d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        (d / "tokenizer_config.json").write_text((base[src] / "tokenizer_config.json").read_text(encoding="utf-8"), encoding="utf-8")
        res[name] = d
    d = load("bytelevel")
    d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    d["model"]["ignore_merges"] = False
    d["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    _flags(d, "<|eot_id|>", lstrip=True, rstrip=True)
    _flags(d, "<|end_of_text|>", single_word=True)
    _added(d, "foo bar", normalized=True, single_word=True)
    _added(d, "<tool>", normalized=False, lstrip=True)
    _added(d, "data", normalized=True)
    save("gpt2_variant", d, "bytelevel")
    d = load("metaspace")
    _flags(d, "</s>", lstrip=True)
    _flags(d, "<s>", rstrip=True)
    _added(d, "[INST]", normalized=True)
    _added(d, "the", normalized=True, single_word=True)
    _added(d, "x y", normalized=False, special=True)
    save("llama2_variant", d, "metaspace")
    for scheme, split in (("always", False), ("never", True), ("first", False)):
        d = load("metaspace_pt")
        d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}
        d["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}
        _flags(d, "<unk>", lstrip=True, rstrip=True, normalized=True)
        save(f"metaspace_{scheme}_{int(split)}", d, "metaspace_pt")
    d = load("metaspace_pt")
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}
    d["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}]}
    d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip", "strip_left": False, "strip_right": True}]}
    save("metaspace_legacy", d, "metaspace_pt")
    d = load("qwen2")
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Split", "pattern": {"String": "e"}, "behavior": "MergedWithPrevious", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Contiguous", "invert": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    save("split_variant", d, "qwen2")
    return res


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    fixtures = os.environ.get("KVSERVE_FIXTURES")
    if fixtures:
        base = pathlib.Path(fixtures) / "tokenizers"
        if all((base / n / "tokenizer.json").exists() for n in FIXTURE_NAMES):
            dirs = {n: base / n for n in FIXTURE_NAMES}
            return {**dirs, **make_variants(dirs, tmp_path_factory.mktemp("variants")), "smollm2": default_model_dir()}
    sys.path.insert(0, str(ROOT / "tools"))
    from make_fixture_tokenizers import make_tokenizers
    dirs = make_tokenizers(tmp_path_factory.mktemp("tokenizers"))
    return {**dirs, **make_variants(dirs, tmp_path_factory.mktemp("variants")), "smollm2": default_model_dir()}


@pytest.fixture(scope="module")
def kvserve_bin() -> str:
    path = os.environ.get("KVSERVE_BIN")
    if not path:
        candidate = ROOT / "build" / "kvserve"
        if not candidate.exists():
            pytest.skip("KVSERVE_BIN is not set and build/kvserve does not exist")
        path = str(candidate)
    return path


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return make_lines()


def _run(bin_path: str, args: list[str]) -> list[str]:
    res = subprocess.run([bin_path, *args], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    out = res.stdout.decode("utf-8")
    assert out.endswith("\n") or out == ""
    return out.split("\n")[:-1]


def invalid_utf8_lines(seed: int = 7, n: int = 300) -> list[bytes]:
    """Text with bytes that are not UTF-8: stray continuation bytes, cut sequences, surrogates."""
    rng = random.Random(seed)
    raw = []
    for _ in range(n):
        good = rng.choice(_EN + _CJK + _EMOJI).encode()
        junk = bytes(rng.choice([0x80, 0xBF, 0xC0, 0xC2, 0xE0, 0xE2, 0xED, 0xF0, 0xF4, 0xF5, 0xFF, 0xA0, 0x9F])
                     for _ in range(rng.randint(1, 4)))
        raw.append(good[: rng.randint(0, len(good))] + junk + good)
    return raw


def lines_for(name: str, lines: list[str]) -> list[str]:
    # The variants only add options on top of the base fixtures: a shorter corpus keeps the suite fast.
    return lines if name in NAMES else lines[:1500]


class Results:
    """Runs kvserve and HF once per tokenizer and mode (each kvserve start loads libtorch) and caches."""

    def __init__(self, dirs, bin_path, lines, tmp):
        self.dirs, self.bin, self.lines, self.tmp = dirs, bin_path, lines, tmp
        self.cache: dict = {}

    def hf(self, name):
        key = ("hf", name)
        if key not in self.cache:
            self.cache[key] = tokenizers.Tokenizer.from_file(str(self.dirs[name] / "tokenizer.json"))
        return self.cache[key]

    def _once(self, key, fn):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def texts(self, name) -> list[bytes]:
        """The corpus lines (as bytes), then for the base fixtures the invalid-UTF-8 lines."""
        extra = invalid_utf8_lines() if name in NAMES else []
        return [l.encode() for l in lines_for(name, self.lines)] + extra

    def kv_ids(self, name, special) -> list[list[int]]:
        def run():
            f = self.tmp / f"{name}-{special}.txt"
            f.write_bytes(b"".join(t + b"\n" for t in self.texts(name)))
            args = ["tokenize", "--model", str(self.dirs[name]), "--text-file", str(f)]
            out = _run(self.bin, args + ([] if special else ["--no-special"]))
            assert len(out) == len(self.texts(name))
            return [json.loads(o) for o in out]
        return self._once(("kv_ids", name, special), run)

    def hf_ids(self, name, special) -> list[list[int]]:
        return self._once(("hf_ids", name, special), lambda: [
            e.ids for e in self.hf(name).encode_batch([t.decode("utf-8", "replace") for t in self.texts(name)],
                                                      add_special_tokens=special)])

    def random_ids(self, name) -> list[list[int]]:
        n = self.hf(name).get_vocab_size(with_added_tokens=True)
        rng = random.Random(3)
        return [[rng.randrange(n) for _ in range(rng.randint(0, 30))] for _ in range(1500 if name in NAMES else 500)]

    def detok_inputs(self, name) -> list[list[int]]:
        return self.hf_ids(name, True) + self.random_ids(name)

    def kv_text(self, name, skip_special) -> list[str]:
        def run():
            ids = self.detok_inputs(name)
            f = self.tmp / f"{name}-{skip_special}.ids"
            f.write_text("".join(json.dumps(i) + "\n" for i in ids), encoding="utf-8")
            args = ["detokenize", "--model", str(self.dirs[name]), "--ids-file", str(f)]
            out = _run(self.bin, args + (["--skip-special"] if skip_special else []))
            assert len(out) == len(ids)
            return [json.loads(o) for o in out]
        return self._once(("kv_text", name, skip_special), run)


@pytest.fixture(scope="module")
def results(tokenizer_dirs, kvserve_bin, lines, tmp_path_factory) -> Results:
    return Results(tokenizer_dirs, kvserve_bin, lines, tmp_path_factory.mktemp("kv"))


def _report(kind: str, bad: list[tuple], total: int) -> str:
    head = "\n".join(f"  {b!r}" for b in bad[:5])
    return f"{len(bad)}/{total} {kind} differ from HF; first:\n{head}"


# --------------------------------------------------------------------------------------------
# Tests.

def test_corpus_has_the_required_mix(lines):
    text = "".join(lines)
    assert len(lines) >= 5000
    for probe in ["数据", "مرحبا", "👨‍👩‍👧‍👦", "👍🏽", "def f(x):", "\t", "\x85", "\x00", "7"]:
        assert probe in text, probe
    assert any(" " * 30 in l for l in lines)


@pytest.mark.parametrize("name,special", [(n, s) for n in NAMES for s in (True, False)] + [(v, True) for v in VARIANTS])
def test_ids_identical_to_hf(name, special, results):
    """Corpus lines (and, for the base fixtures, invalid UTF-8 lines, which must tokenize as
    Python's errors='replace' decoding of them) give exactly HF's ids."""
    got, want, texts = results.kv_ids(name, special), results.hf_ids(name, special), results.texts(name)
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, _report("token id lists", bad, len(texts))


@pytest.mark.parametrize("name", NAMES)
def test_multiline_texts_identical_to_hf(name, results, tmp_path):
    texts = make_multiline_texts()
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    out = _run(results.bin, ["tokenize", "--model", str(results.dirs[name]), "--text-file", str(f), "--json-input"])
    got = [json.loads(o) for o in out]
    want = [e.ids for e in results.hf(name).encode_batch(texts)]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert len(got) == len(texts) and not bad, _report("token id lists", bad, len(texts))


@pytest.mark.parametrize("name,skip_special", [(n, s) for n in NAMES for s in (False, True)] +
                         [(v, False) for v in VARIANTS])
def test_detokenize_matches_hf(name, skip_special, results):
    """Decoding HF's ids of the corpus, and random id sequences (split characters, stray byte
    pieces, specials), gives HF's text."""
    ids = results.detok_inputs(name)
    want = results.hf(name).decode_batch(ids, skip_special_tokens=skip_special)
    got = results.kv_text(name, skip_special)
    # The acceptance criterion: round trips wherever HF's do ...
    if skip_special:
        lines = lines_for(name, results.lines)
        roundtrip = [i for i, l in enumerate(lines) if want[i] == l]
        assert len(roundtrip) > len(lines) // 4
        bad_rt = [(lines[i], got[i]) for i in roundtrip if got[i] != lines[i]]
        assert not bad_rt, _report("round trips", bad_rt, len(roundtrip))
    # ... and, stronger, the same text as HF's decode everywhere.
    bad = [(i, g, w) for i, g, w in zip(ids, got, want) if g != w]
    assert not bad, _report("decoded texts", bad, len(ids))


def test_cli_errors_are_clean(tokenizer_dirs, kvserve_bin, tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("[1, 2, \"x\"]\n", encoding="utf-8")
    res = subprocess.run([kvserve_bin, "detokenize", "--model", str(tokenizer_dirs["bytelevel"]), "--ids-file", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and res.stderr.startswith("kvserve: error: ") and "ids.txt:1" in res.stderr
    bad_model = tmp_path / "bad"
    bad_model.mkdir()
    (bad_model / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}}}', encoding="utf-8")
    res = subprocess.run([kvserve_bin, "tokenize", "--model", str(bad_model), "--text-file", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "tokenizer.json" in res.stderr and "model.merges" in res.stderr


@pytest.mark.parametrize("pattern", [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"\w+|[\w\s]+|."], ids=["llama3", "word"])
def test_regex_classes_match_oniguruma_on_every_code_point(pattern, kvserve_bin, tmp_path):
    """PCRE2 with kvserve's rewrites splits exactly like HF's Oniguruma, for every assigned code
    point (in this Python's Unicode database) up to U+2FFFF. A model that maps each pre-token to one
    fused <unk> makes the id count equal the number of pre-tokens."""
    tj = {"version": "1.0", "added_tokens": [], "normalizer": None, "post_processor": None, "decoder": None,
          "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
          "model": {"type": "BPE", "vocab": {"<unk>": 0}, "merges": [], "unk_token": "<unk>", "fuse_unk": True}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    cps = [c for c in map(chr, range(0x30000)) if c != "\n" and unicodedata.category(c) not in ("Cs", "Cn")]
    texts = ["".join(f"a{c}{c}a 1{c}1 {c} 's{c}'S" for c in cps[i:i + 8]) for i in range(0, len(cps), 8)]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    got = [len(json.loads(o)) for o in _run(kvserve_bin, ["tokenize", "--model", str(tmp_path), "--text-file", str(f),
                                                          "--json-input", "--no-special"])]
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    want = [len(e.ids) for e in hf.encode_batch(texts, add_special_tokens=False)]
    bad = [t for t, g, w in zip(texts, got, want) if g != w]
    assert not bad, _report("pre-token counts", bad, len(texts))
