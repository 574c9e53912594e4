#!/usr/bin/env python3
"""Writes the local lm-evaluation-harness tasks kvserve ships (tools/lmeval_tasks/, used by
tools/eval_lmeval.py and `make eval-lmeval`; no hub download, everything offline):

  retrieval.jsonl   --n documents of about --doc-tokens tokens of tools/retrieval_tasks.py's "story"
                    filler, each hiding one secret code ("The secret code of the amber falcon vault
                    is 4821930.") at a depth of its own (evenly spread, also over any first
                    k documents), and the question asking for it.
  mc.jsonl          --mc-n short delivery logs (tools/context_doc.py's records) with a four-way
                    multiple-choice question about one record (which city, which goods).

Two task YAMLs read retrieval.jsonl (generate_until, scored by lmeval_tasks/utils.py):
  kvserve_retrieval_onemsg   the document and the question in one user message (lm-eval's normal
                             layout with --apply_chat_template)
  kvserve_retrieval_docsys   the document as the system message (the task's `description`, which
                             lm-eval renders per document and sends as the system message under
                             --apply_chat_template), the question as the user message
and kvserve_mc (multiple_choice, loglikelihood) reads mc.jsonl. The YAMLs and utils.py are
committed as they are; this script only writes the two .jsonl files, deterministically from
--seed (the document lengths are counted with the default model's tokenizer.json).

  python3 tools/make_lmeval_tasks.py                 # rewrites tools/lmeval_tasks/*.jsonl
  python3 tools/make_lmeval_tasks.py --check         # fails if the committed files differ
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import context_doc  # noqa: E402
from retrieval_tasks import ADJS, ANIMALS, COLORS, WORDS, haystack_sentence, make_cast  # noqa: E402

OUT = REPO / "tools" / "lmeval_tasks"
HEAD = "Read the following document carefully. A secret code is hidden somewhere inside it."
QUESTION = "What is the secret code of the {key} vault mentioned in the document? Answer with the code only."


def depth_slot(i: int, n: int) -> int:
    """Document i's depth slot: a stride coprime with n walks every slot once, so that any first k
    documents (lm-eval's --limit k) have needles spread over the whole depth range."""
    k = max(1, n // 4)
    while math.gcd(k, n) != 1:
        k += 1
    return (i * k) % n


def retrieval_doc(tok, i: int, n: int, doc_tokens: int, seed: int) -> dict:
    """Document i of n: filler up to doc_tokens, one needle at depth (depth_slot(i, n) + 0.5) / n."""
    rng = random.Random(f"lmeval-retrieval/{seed}/{i}")
    key = f"{rng.choice(ADJS)} {rng.choice(COLORS + ANIMALS + WORDS)}"
    code = str(rng.randint(1, 9)) + "".join(str(rng.randrange(10)) for _ in range(6))
    needle = f"The secret code of the {key} vault is {code}."
    cast = make_cast(rng)
    sents, total = [], len(tok.encode(HEAD + " " + needle).ids)
    while total < doc_tokens:
        s = " " + haystack_sentence(rng, cast)
        sents.append(s)
        total += len(tok.encode(s).ids)
    sents.pop()  # stay at or under doc_tokens
    depth = (depth_slot(i, n) + 0.5) / n
    at = round(depth * len(sents))
    document = HEAD + "".join(sents[:at]) + " " + needle + "".join(sents[at:])
    return {"id": i, "document": document, "question": QUESTION.format(key=key), "answer": code,
            "depth": round(depth, 4), "doc_tokens": len(tok.encode(document).ids)}


def mc_item(i: int, seed: int) -> dict:
    """A delivery log of 6 records and a four-way question about one of them."""
    rng = random.Random(f"lmeval-mc/{seed}/{i}")
    recs = context_doc.records(6, seed=rng.randrange(1 << 30))
    passage = context_doc.document(recs)
    r = rng.choice(recs)
    if i % 2 == 0:
        question = f"According to record {r['id']}, to which city did {r['name']} deliver {r['goods']}?"
        right, pool = r["city"], context_doc.CITIES
    else:
        question = f"According to record {r['id']}, what did {r['name']} deliver to {r['city']}?"
        right, pool = r["goods"], context_doc.GOODS
    choices = [right] + rng.sample([x for x in pool if x != right], 3)
    rng.shuffle(choices)
    return {"id": i, "passage": passage, "question": question, "choices": choices, "label": choices.index(right)}


def build(tokenizer_json: pathlib.Path, n: int, doc_tokens: int, mc_n: int, seed: int) -> dict[str, str]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    retrieval = [retrieval_doc(tok, i, n, doc_tokens, seed) for i in range(n)]
    mc = [mc_item(i, seed) for i in range(mc_n)]
    dump = lambda rows: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)  # noqa: E731
    return {"retrieval.jsonl": dump(retrieval), "mc.jsonl": dump(mc)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "smollm2-135m-instruct" / "tokenizer.json"))
    ap.add_argument("--n", type=int, default=30, help="retrieval documents")
    ap.add_argument("--doc-tokens", type=int, default=1500, help="tokens per retrieval document (at most)")
    ap.add_argument("--mc-n", type=int, default=30, help="multiple-choice items")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    a = ap.parse_args(argv)
    files = build(pathlib.Path(a.tokenizer), a.n, a.doc_tokens, a.mc_n, a.seed)
    out = pathlib.Path(a.out)
    bad = 0
    for name, text in files.items():
        path = out / name
        if a.check:
            same = path.exists() and path.read_text() == text
            print(f"{path}: {'same' if same else 'DIFFERS'}")
            bad += not same
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"{path}: {text.count(chr(10))} rows, {len(text.encode())} bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
