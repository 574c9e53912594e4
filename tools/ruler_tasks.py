"""RULER-style long-context tasks, generated locally from a seed (no downloads).

Each sample is a chat prompt for an instruct model (the context and the question in one user turn,
then the assistant turn opened with an answer prefix, as RULER does) plus the strings that must
appear in the model's answer; for a base model (no chat template) the same text as a plain
completion (STYLES). The haystack is tools/retrieval_tasks.py's "story" filler.

Tasks (RULER's names in brackets):
  niah_number    one "special magic number" needle [niah_single_1/2]
  niah_word      the same with a word value
  niah_uuid      the same with a UUID value [niah_single_3]
  multikey       4 needles with different keys, one asked for [niah_multikey_1]
  multivalue     4 values for the same key, all asked for [niah_multivalue]
  multiquery     4 keys, 2 asked for at once [niah_multiquery]
  vt             variable tracking: a chain of 4 assignments, all names asked for [vt]
  cwe            common words: a numbered word list, the 3 most common asked for [cwe]
  fwe            frequent words: random "coded" words, the 3 most frequent asked for [fwe]
  qa             question answering over a synthetic document of short biographies [qa]

A sample is correct when every expected string occurs in the greedy answer (case-insensitive).
"""
from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field

from retrieval_tasks import ANIMALS, CITIES, COLORS, NAMES, OBJECTS, PLACES, WORDS, haystack_sentence, make_cast

TASKS = ("niah_number", "niah_word", "niah_uuid", "multikey", "multivalue", "multiquery", "vt", "cwe", "fwe", "qa")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# What comes before the context and between the question and the answer prefix: SmolLM2's chat
# (ChatML), or a plain completion for a base model (RULER's base-model format: the question on its
# own line, the answer prefix after it).
STYLES = {"chatml": (SYSTEM + "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
          "completion": ("", "\n")}
MAX_TOKENS = {"niah_number": 16, "niah_word": 12, "niah_uuid": 28, "multikey": 16, "multivalue": 48,
              "multiquery": 40, "vt": 32, "cwe": 24, "fwe": 24, "qa": 12}
KEYWORDS = sorted(set(WORDS + COLORS + ANIMALS))


@dataclass
class Sample:
    task: str
    length: int           # the target prompt length in tokens
    prompt: str           # the whole chat prompt (system, user turn, assistant answer prefix)
    answers: list         # strings that must all occur in the answer
    needles: list = field(default_factory=list)  # (start, end) character spans of the facts asked for
    max_tokens: int = 16
    ids: list = field(default_factory=list)      # filled by tokenize()

    def correct(self, output: str) -> bool:
        low = output.lower()
        return all(a.lower() in low for a in self.answers)


def _digits(rng: random.Random, n: int = 7) -> str:
    return str(rng.randint(1, 9)) + "".join(rng.choice(string.digits) for _ in range(n - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _keys(rng: random.Random, n: int) -> list:
    out: list = []
    while len(out) < n:
        k = f"{rng.choice(KEYWORDS)}-{rng.choice(KEYWORDS)}"
        if k not in out:
            out.append(k)
    return out


class TaskMaker:
    """Builds samples of a target token length with a `tokenizers.Tokenizer` (counts only)."""

    def __init__(self, tokenizer, style: str = "chatml"):
        self.tok = tokenizer
        self.open, self.close = STYLES[style]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def _filler(self, rng: random.Random, n_tokens: int) -> list:
        cast = make_cast(rng)
        sents, total = [], 0
        while total < n_tokens:
            batch = [" " + haystack_sentence(rng, cast) for _ in range(32)]
            for s, e in zip(batch, self.tok.encode_batch(batch, add_special_tokens=False)):
                if total >= n_tokens:
                    break
                sents.append(s)
                total += len(e.ids)
        return sents

    def _wrap(self, task, length, rng, head, facts, question, prefix, answers, asked=None) -> Sample:
        """facts: sentences inserted at random depths in the filler; `asked` indexes the needles."""
        fixed = self.count(head + " ".join(facts) + question + prefix) + 40
        sents = self._filler(rng, max(0, length - fixed))
        slots = sorted(rng.randrange(len(sents) + 1) for _ in facts)
        order = list(range(len(facts)))
        rng.shuffle(order)
        body, spans, fi = head, {}, 0
        for i in range(len(sents) + 1):
            while fi < len(slots) and slots[fi] == i:
                start = len(self.open) + len(body) + 1
                body += " " + facts[order[fi]]
                spans[order[fi]] = (start, start + len(facts[order[fi]]))
                fi += 1
            if i < len(sents):
                body += sents[i]
        prompt = f"{self.open}{body}\n\n{question}{self.close}{prefix}"
        asked = range(len(facts)) if asked is None else asked
        return Sample(task, length, prompt, answers, [spans[i] for i in asked], MAX_TOKENS[task])

    def make(self, task: str, length: int, seed: int) -> Sample:
        rng = random.Random(f"{task}/{length}/{seed}")
        head = "Some special magic values are hidden inside the following text. Make sure to memorize them."
        if task in ("niah_number", "niah_word", "niah_uuid"):
            key = rng.choice(KEYWORDS)
            kind = {"niah_number": "number", "niah_word": "word", "niah_uuid": "uuid"}[task]
            v = _digits(rng) if kind == "number" else (rng.choice(CITIES) if kind == "word" else _uuid(rng))
            fact = f"One of the special magic {kind}s for {key} is: {v}."
            q = f"What is the special magic {kind} for {key} mentioned in the provided text?"
            return self._wrap(task, length, rng, head, [fact], q,
                              f"The special magic {kind} for {key} mentioned in the provided text is", [v])
        if task in ("multikey", "multiquery"):
            keys, vals = _keys(rng, 4), [_digits(rng) for _ in range(4)]
            facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
            if task == "multikey":
                i = rng.randrange(4)
                q = f"What is the special magic number for {keys[i]} mentioned in the provided text?"
                return self._wrap(task, length, rng, head, facts, q,
                                  f"The special magic number for {keys[i]} mentioned in the provided text is",
                                  [vals[i]], [i])
            i, j = rng.sample(range(4), 2)
            q = (f"What are the special magic numbers for {keys[i]} and {keys[j]} mentioned in the provided "
                 "text?")
            return self._wrap(task, length, rng, head, facts, q,
                              f"The special magic numbers for {keys[i]} and {keys[j]} mentioned in the provided "
                              "text are", [vals[i], vals[j]], [i, j])
        if task == "multivalue":
            key, vals = rng.choice(KEYWORDS), [_digits(rng) for _ in range(4)]
            facts = [f"One of the special magic numbers for {key} is: {v}." for v in vals]
            q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
            return self._wrap(task, length, rng, head, facts, q,
                              f"The special magic numbers for {key} mentioned in the provided text are", vals)
        if task == "vt":
            names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(5)]
            v = _digits(rng, 5)
            facts = [f"VAR {names[0]} = {v}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
            # The chain must read in order: insert in order at increasing depths.
            rng2 = random.Random(rng.random())
            sample = self._wrap(task, length, rng2, "Memorize and track the chain of variable assignments hidden "
                                "in the following text.", facts,
                                f"Find all variables that are assigned the value {v} in the text above.",
                                f"According to the chain of variable assignments in the text above, {len(names)} "
                                "variables are assigned the value " + v + ", they are:", names)
            return _ordered(sample, facts)
        if task in ("cwe", "fwe"):
            return self._words(task, length, rng)
        if task == "qa":
            return self._qa(length, rng)
        raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")

    def _words(self, task: str, length: int, rng: random.Random) -> Sample:
        if task == "cwe":
            vocab = rng.sample(KEYWORDS, len(KEYWORDS))
            common, rare = vocab[:3], vocab[3:]
            n_words = max(20, (length - 120) // 6)  # a numbered item costs about 6 tokens
            items = [w for w in common for _ in range(max(6, n_words // 12))]
            while len(items) < n_words:
                items.append(rng.choice(rare))
            rng.shuffle(items)
            text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
            head = "Below is a numbered list of words. In these words, some appear more often than others."
            q = "What are the 3 most common words in the above list?"
            prefix = "Answer: The top 3 words that appear most often in the list are:"
            answers = common
        else:
            coded = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 6))) for _ in range(60)]
            weights = [1.0 / (r + 1) ** 1.3 for r in range(len(coded))]
            n_words = max(30, (length - 120) // 3)
            items = rng.choices(coded, weights, k=n_words)
            counts = {w: items.count(w) for w in set(items)}
            answers = sorted(counts, key=lambda w: -counts[w])[:3]
            text = " ".join(items)
            head = "Read the following coded text and track the frequency of each coded word."
            q = "What are the three most frequently appeared words in the above coded text?"
            prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        prompt = f"{self.open}{head} {text}\n\n{q}{self.close}{prefix}"
        return Sample(task, length, prompt, answers, [], MAX_TOKENS[task])

    def _qa(self, length: int, rng: random.Random) -> Sample:
        people = []
        total = 0
        budget = max(40, length - 120)
        while total < budget:
            p = (f"{rng.choice(NAMES)} {rng.choice(string.ascii_uppercase)}. {rng.choice(['Smith', 'Lee', 'Brown', 'Garcia', 'Novak', 'Costa', 'Berg', 'Moreau'])}",
                 rng.choice(CITIES), rng.choice(OBJECTS), rng.choice(PLACES), rng.choice(ANIMALS), rng.randint(1900, 1999))
            if any(p[0] == q[0] for q in people):
                continue
            people.append(p)
            total += 45
        paras = [f"{n} was born in {c} in {y}. {n.split()[0]} later worked in a {pl} and owned a {a}. "
                 f"Friends say {n.split()[0]} always carried a {o}." for n, c, o, pl, a, y in people]
        ask = rng.randrange(len(people))
        n, c = people[ask][0], people[ask][1]
        head = "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n"
        body = ""
        span = (0, 0)
        for i, para in enumerate(paras):
            if i == ask:
                start = len(self.open) + len(head) + len(body) + len(f"Document {i + 1}: ")
                span = (start, start + len(para))
            body += f"Document {i + 1}: {para}\n"
        q = f"In which city was {n} born?"
        prompt = f"{self.open}{head}{body}\nQuestion: {q}{self.close}Answer:"
        return Sample("qa", length, prompt, [c], [span], MAX_TOKENS["qa"])


def _ordered(sample: Sample, facts: list) -> Sample:
    """Variable tracking needs the assignments in chain order: rewrite the body so the facts appear
    in list order at the positions the random insertion chose."""
    spans = sorted(sample.needles)
    text = sample.prompt
    pieces, last = [], 0
    for (s, e), fact in zip(spans, facts):
        pieces.append(text[last:s])
        pieces.append(fact)
        last = e
    pieces.append(text[last:])
    new = "".join(pieces)
    # Facts of different lengths shift later spans: recompute them by search, in order.
    out, pos = [], 0
    for fact in facts:
        s = new.index(fact, pos)
        out.append((s, s + len(fact)))
        pos = s + len(fact)
    sample.prompt, sample.needles = new, out
    return sample


def tokenize(tokenizer, samples: list, bos: int | None = None) -> list:
    """Fills each sample's ids (the chat prompt's special tokens are in the text; no BOS for SmolLM2,
    `bos` first for a model that wants one, as Gemma)."""
    encs = tokenizer.encode_batch([s.prompt for s in samples], add_special_tokens=False)
    for s, e in zip(samples, encs):
        s.ids = ([bos] if bos is not None else []) + e.ids
    return samples


def prompt_style(model_dir) -> tuple[str, int | None]:
    """(style, BOS id or None) for a converted model: ChatML where its chat template is ChatML, else a
    plain completion; BOS where its tokenizer adds one."""
    import json
    import pathlib
    from tokenizers import Tokenizer
    d = pathlib.Path(model_dir)
    cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
    style = "chatml" if "<|im_start|>" in str(cfg.get("chat_template", "")) else "completion"
    bos = None
    if cfg.get("add_bos_token") and isinstance(cfg.get("bos_token"), str):
        bos = Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(cfg["bos_token"])
    return style, bos


def needle_token_positions(tokenizer, sample: Sample) -> list:
    """Token indices whose characters overlap the asked-for facts."""
    enc = tokenizer.encode(sample.prompt, add_special_tokens=False)
    out = []
    for i, (a, b) in enumerate(enc.offsets):
        if any(a < e and b > s for s, e in sample.needles):
            out.append(i)
    return out
