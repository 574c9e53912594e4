"""A synthetic document of delivery records and questions about it, for the compressed-context test
and benchmark (tests/integration/test_compressed_context_server.py, tools/bench_context_cache.py):
plain English the default model reads, with facts a question can point at."""
from __future__ import annotations

import random

NAMES = ["Alice Brown", "Omar Haddad", "Mei Lin", "Jonas Berg", "Priya Nair", "Lucas Silva", "Sara Novak",
         "Kenji Mori", "Ada Okafor", "Tomas Ruiz", "Elena Petrova", "Yusuf Demir"]
GOODS = ["tea", "copper wire", "olive oil", "wool", "glass jars", "rice", "paper", "salt", "coffee", "tin cans"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Hanoi", "Perth", "Quebec", "Tunis", "Riga", "Accra", "Porto", "Kyoto"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i + 1, "name": rng.choice(NAMES), "count": rng.randrange(2, 99), "goods": rng.choice(GOODS),
             "city": rng.choice(CITIES), "day": rng.choice(DAYS)} for i in range(n)]


def document(recs: list[dict]) -> str:
    lines = ["The delivery log of the northern warehouse lists every shipment of the season."]
    for r in recs:
        lines.append(f"Record {r['id']}: {r['name']} delivered {r['count']} crates of {r['goods']} to "
                     f"{r['city']} on a {r['day']}.")
    return "\n".join(lines)


def questions(recs: list[dict], k: int, seed: int = 1) -> list[tuple[str, str]]:
    """k (question, answer) pairs about distinct records."""
    rng = random.Random(seed)
    out = []
    for r in rng.sample(recs, k):
        out.append((f"In record {r['id']}, how many crates were delivered? Answer with the number only.", str(r["count"])))
    return out


def document_of_tokens(tokenizer, target: int, seed: int = 0) -> tuple[str, list[dict]]:
    """The longest document of whole records with at most `target` tokens (tokenizer: a `tokenizers`
    Tokenizer or a transformers one)."""
    def count(text: str) -> int:
        enc = tokenizer.encode(text)
        return len(enc.ids) if hasattr(enc, "ids") else len(enc)
    lo, hi = 1, max(2, target // 10)
    while lo < hi:  # the largest n whose document fits
        mid = (lo + hi + 1) // 2
        if count(document(records(mid, seed))) <= target:
            lo = mid
        else:
            hi = mid - 1
    recs = records(lo, seed)
    return document(recs), recs
