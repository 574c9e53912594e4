"""Long-context retrieval tasks shared by tools/train_tiny_model.py and tools/eval_retrieval.py.

Every sample is built from *segments* (strings). Each segment after the first starts with a space
(or a newline / special token), so the tokenizer's pre-tokenizer never merges across a segment
boundary and the ids of the whole text equal the concatenated ids of its segments; this lets a
sample be built to an exact token length cheaply. `check_segment_concat` verifies it.

Tasks (all end in a question whose answer the model must copy from the context):
  passkey   "The pass key is 48213. Remember it. 48213 is the pass key." in a haystack;
            "What is the pass key? The pass key is" -> " 48213"
  needle    one fact from five templates (magic number of a city, favourite colour, secret word,
            where something is kept, door code) at a given depth; question -> the fact's value
  multikey  2-8 "The value of key amber-falcon is 381904." facts scattered; asked for one
  continue  plain haystack text (language modelling; no question)
The haystack of a document has one of three styles: "story" (~20 sentence templates over word lists,
with a per-document cast of people/places/objects that recur, so it has some long-range structure),
"classic" (the five sentences of the passkey papers, "The grass is green. The sky is blue. ...",
repeated) and "mixed" (story sentences with classic ones between them).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

NAMES = ("Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Noah Olga Peter "
         "Quinn Rosa Sam Tina Umar Vera Walter Xenia Yusuf Zoe Anna Boris Clara Diego Elena Felix "
         "Hana Ivan Julia Kofi Lena Marco Nina Oscar Paula Rafael Sofia Tomas Ursula Viktor Wendy "
         "Yara Aaron Bianca Carlos Daria Erik Fiona Gustav Helga Igor Jonas Kira Lars Mila").split()
CITIES = ("Paris London Berlin Madrid Rome Vienna Prague Warsaw Lisbon Dublin Oslo Stockholm Helsinki "
          "Athens Cairo Nairobi Lagos Tokyo Kyoto Seoul Beijing Shanghai Delhi Mumbai Dhaka Bangkok "
          "Hanoi Manila Jakarta Sydney Perth Auckland Lima Quito Bogota Santiago Havana Toronto "
          "Boston Chicago Denver Seattle Houston Phoenix Miami Dallas Austin Montreal Geneva Zurich "
          "Munich Hamburg Milan Naples Porto Seville Krakow Riga Tallinn Vilnius Sofia Bucharest").split()
COLORS = ("red blue green yellow purple orange pink brown black white gray violet indigo crimson "
          "teal maroon olive navy silver golden amber coral turquoise beige").split()
ANIMALS = ("cat dog horse tiger lion eagle falcon owl wolf fox bear rabbit deer otter whale shark "
           "dolphin panda koala camel zebra goat sheep crow raven swan heron badger beaver lynx "
           "moose bison").split()
ADJS = ("quiet bright small large old young happy sleepy clever brave gentle busy lazy wild calm "
        "proud tiny ancient silent rapid curious golden hidden frozen distant lucky noisy shy "
        "careful strange").split()
OBJECTS = ("key book lamp map letter ring coin box clock bottle hammer knife basket blanket kettle "
           "camera ticket wallet umbrella compass notebook candle mirror ladder").split()
PLACES = ("kitchen garden garage attic cellar library office bedroom hallway barn shed studio "
          "workshop pantry basement balcony closet lobby").split()
WORDS = ("apple river mountain thunder window pepper silver marble candle forest ocean meadow "
         "harbor lantern velvet copper maple willow crystal ember falcon harvest island jasmine "
         "kettle lemon mango nectar orchid pebble quartz saffron tulip walnut zephyr cobalt dune "
         "glacier").split()
NOUNS = ("farmer teacher doctor painter sailor baker writer driver nurse singer pilot miner "
         "student clerk guard merchant hunter poet builder gardener").split()
VERBS_PAST = ("visited watched painted carried found repaired cleaned opened followed described "
              "photographed measured borrowed sold bought moved counted noticed").split()
THINGS = ("bridge tower fountain market station museum river road field village harbor castle "
          "church school factory forest lake hill valley square").split()
WEATHER = ("rain snow wind fog sunshine frost thunder hail").split()
TIMES = ("morning afternoon evening night dawn dusk").split()
DAYS = ("Monday Tuesday Wednesday Thursday Friday Saturday Sunday").split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
FOODS = ("bread soup rice cheese fish apples beans noodles salad cake tea coffee honey").split()


@dataclass
class Cast:
    """The people, places and things one document keeps returning to."""
    names: list
    cities: list
    things: list
    nouns: list


def make_cast(rng: random.Random) -> Cast:
    return Cast(rng.sample(NAMES, 6), rng.sample(CITIES, 4), rng.sample(THINGS, 5), rng.sample(NOUNS, 4))


def haystack_sentence(rng: random.Random, cast: Cast) -> str:
    """One filler sentence (no leading space)."""
    c = rng.choice
    n, ci, th, no = c(cast.names), c(cast.cities), c(cast.things), c(cast.nouns)
    k = rng.randrange(22)
    if k == 0:
        return f"{n} {c(VERBS_PAST)} the {c(ADJS)} {th} near {ci}."
    if k == 1:
        return f"In the {c(TIMES)}, the {no} from {ci} walked to the {th}."
    if k == 2:
        return f"The {c(WEATHER)} lasted for {rng.randint(2, 30)} days in {ci}."
    if k == 3:
        return f"{n} and {c(cast.names)} shared some {c(FOODS)} by the {th}."
    if k == 4:
        return f"On {c(DAYS)} the {c(ADJS)} {c(ANIMALS)} slept under the {th}."
    if k == 5:
        return f"Every {c(MONTHS)}, people in {ci} talk about the old {th}."
    if k == 6:
        return f"The {no} said that the {th} was {c(ADJS)} and {c(ADJS)}."
    if k == 7:
        return f"{n} wrote a long letter about {ci} and its {th}."
    if k == 8:
        return f"Nobody in the {th} remembered the {c(ADJS)} {no}."
    if k == 9:
        return f"A {c(ANIMALS)} crossed the road while {n} was reading."
    if k == 10:
        return f"There were {rng.randint(3, 90)} {c(ANIMALS)}s in the {th} that {c(TIMES)}."
    if k == 11:
        return f"{n} thinks the {c(WEATHER)} in {ci} is worse than anywhere else."
    if k == 12:
        return f"The road from {ci} to {c(cast.cities)} passes a {c(ADJS)} {th}."
    if k == 13:
        return f"After the {c(WEATHER)}, {n} {c(VERBS_PAST)} the {th} again."
    if k == 14:
        return f"The {c(ADJS)} {no} sold {c(FOODS)} at the market in {ci}."
    if k == 15:
        return f"{n} asked {c(cast.names)} why the {th} was closed."
    if k == 16:
        return f"It was a {c(ADJS)} {c(TIMES)} and the {c(ANIMALS)} was {c(ADJS)}."
    if k == 17:
        return f"Later that {c(TIMES)}, {n} {c(VERBS_PAST)} a {c(ADJS)} {c(OBJECTS)}."
    if k == 18:
        return f"The {th} of {ci} is known for its {c(ADJS)} {c(ANIMALS)}s."
    if k == 19:
        return f"{n} told the {no} a story about a {c(ADJS)} {c(ANIMALS)}."
    if k == 20:
        return f"In {c(MONTHS)} the {no}s of {ci} {c(VERBS_PAST)} the {th}."
    return f"{n} and the {no} waited near the {th} until {c(TIMES)}."


CLASSIC = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
HAYSTACK_STYLES = (("story", 0.7), ("classic", 0.15), ("mixed", 0.15))


def pick_style(rng: random.Random) -> str:
    r, acc = rng.random(), 0.0
    for style, p in HAYSTACK_STYLES:
        acc += p
        if r < acc:
            return style
    return HAYSTACK_STYLES[0][0]


def filler_sentence(rng: random.Random, cast: Cast, style: str, i: int) -> str:
    """The i-th filler sentence of a document in `style` (no leading space)."""
    if style == "classic" or (style == "mixed" and rng.random() < 0.5):
        return CLASSIC[i % len(CLASSIC)]
    return haystack_sentence(rng, cast)


def digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(n - 1))


@dataclass
class Sample:
    task: str
    prefix: list          # segments of the prompt (the question ends it)
    answer: str           # what the model must generate next (starts with a space)
    suffix: str = "."     # after the answer (the training target also holds it)
    meta: dict = field(default_factory=dict)


NEEDLE_KINDS = ("magic", "color", "word", "keep", "code")


def needle_fact(rng: random.Random, kind: str | None = None, cast: Cast | None = None):
    """(fact sentence, question, answer prefix, answer) of one needle."""
    kind = kind or rng.choice(NEEDLE_KINDS)
    if kind == "magic":
        city, v = rng.choice(CITIES), digits(rng, 7)
        return (f"The special magic number for {city} is {v}.",
                f"What is the special magic number for {city}?",
                f"The special magic number for {city} is", f" {v}")
    if kind == "color":
        name, v = rng.choice(NAMES), rng.choice(COLORS)
        return (f"{name}'s favorite color is {v}.", f"What is {name}'s favorite color?",
                f"{name}'s favorite color is", f" {v}")
    if kind == "word":
        a, an, v = rng.choice(ADJS), rng.choice(ANIMALS), rng.choice(WORDS)
        return (f"The secret word of the {a} {an} is {v}.", f"What is the secret word of the {a} {an}?",
                f"The secret word of the {a} {an} is", f" {v}")
    if kind == "keep":
        name, o, v = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(PLACES)
        return (f"{name} keeps the {o} in the {v}.", f"Where does {name} keep the {o}?",
                f"{name} keeps the {o} in the", f" {v}")
    place, v = rng.choice(PLACES), digits(rng, rng.randint(4, 6))
    return (f"The code to open the {place} door is {v}.", f"What is the code to open the {place} door?",
            f"The code to open the {place} door is", f" {v}")


class Builder:
    """Builds samples to an exact token length with a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer, bos_id: int):
        self.tok = tokenizer
        self.bos = bos_id
        self._cache: dict[str, list] = {}

    def ids(self, seg: str) -> list:
        got = self._cache.get(seg)
        if got is None:
            got = self.tok.encode(seg, add_special_tokens=False).ids
            if len(self._cache) < 200000:
                self._cache[seg] = got
        return got

    def many(self, segs: list) -> list:
        out = self.tok.encode_batch(segs, add_special_tokens=False)
        return [e.ids for e in out]

    def haystack(self, rng: random.Random, cast: Cast, n_tokens: int, lead_space=True, style: str = "story"):
        """(segments, ids) of filler text of exactly n_tokens tokens (the last sentence may be cut)."""
        segs, ids = [], []
        start = rng.randrange(len(CLASSIC))
        while len(ids) < n_tokens:
            sents = [(" " if (segs or lead_space) or i else "") + filler_sentence(rng, cast, style, start + len(segs) + i)
                     for i in range(16)]
            for s, e in zip(sents, self.many(sents)):
                if len(ids) >= n_tokens:
                    break
                segs.append(s)
                ids.extend(e)
        if len(ids) > n_tokens:  # cut the last sentence to fit; keep text and ids consistent
            extra = len(ids) - n_tokens
            last = self.ids(segs[-1])
            keep = last[: len(last) - extra]
            segs[-1] = self.tok.decode(keep, skip_special_tokens=False)
            ids = ids[:n_tokens]
            if self.ids(segs[-1]) != keep:  # decoding did not round-trip: drop the sentence instead
                ids = ids[: len(ids) - len(keep)]
                segs.pop()
        return segs, ids


def build(builder: Builder, rng: random.Random, task: str, length: int, depth: float | None = None,
          chat: bool = False, n_keys: int | None = None, passkey_digits: int | None = None,
          n_needles: int = 1, style: str | None = None):
    """A sample of `task` whose prompt+answer is about `length` tokens; `style` is the haystack's
    (random when None, see HAYSTACK_STYLES).

    Returns (prompt_text, prompt_ids, answer_text, target_ids, meta); prompt_ids starts with BOS,
    target_ids = ids of answer + suffix (+ eot for chat).
    """
    cast = make_cast(rng)
    style = style or pick_style(rng)
    depth = rng.random() if depth is None else depth
    facts: list = []   # (segment) inserted at relative depth
    if task == "passkey":
        v = digits(rng, passkey_digits or rng.randint(4, 7))
        head = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it."
        facts = [(depth, f" The pass key is {v}. Remember it. {v} is the pass key.")]
        question, qprefix, answer = " What is the pass key?", " The pass key is", f" {v}"
        meta = {"depth": depth, "key": v}
    elif task == "needle":
        kinds = rng.sample(NEEDLE_KINDS, max(1, n_needles))
        nf = [needle_fact(rng, k) for k in kinds]
        fact, q, ap, answer = nf[0]
        head = "Read the following text and answer the question at the end."
        facts = [(depth, " " + fact)] + [(rng.random(), " " + f[0]) for f in nf[1:]]
        question, qprefix = " " + q, " " + ap
        meta = {"depth": depth, "extra_qa": [(" " + f[1], " " + f[2], f[3]) for f in nf[1:]]}
    elif task == "multikey":
        k = n_keys or rng.randint(2, 8)
        keys = set()
        while len(keys) < k:
            keys.add(f"{rng.choice(ADJS)}-{rng.choice(ANIMALS)}")
        keys = sorted(keys)
        rng.shuffle(keys)
        vals = [digits(rng, 6) for _ in keys]
        ask = rng.randrange(k)
        depths = sorted(rng.random() for _ in keys)
        if depth is not None and task == "multikey":
            depths[ask] = depth
        head = "Below are several keys and their values, hidden in some text. Remember them."
        facts = [(d, f" The value of key {kk} is {vv}.") for d, kk, vv in zip(depths, keys, vals)]
        question = f" What is the value of key {keys[ask]}?"
        qprefix, answer = f" The value of key {keys[ask]} is", f" {vals[ask]}"
        meta = {"depth": depths[ask], "n_keys": k,
                "extra_qa": [(f" What is the value of key {kk}?", f" The value of key {kk} is", f" {vv}")
                             for i, (kk, vv) in enumerate(zip(keys, vals)) if i != ask]}
    elif task == "copy":
        # Induction warm-up (training only): a random list, then the same list again as the answer.
        n = max(4, min(40, length // 12))
        pool = WORDS + COLORS + ANIMALS + CITIES
        items = [digits(rng, rng.randint(1, 4)) if rng.random() < 0.4 else rng.choice(pool) for _ in range(n)]
        listing = " " + " ".join(items)
        head = "Here is a list of items:" + listing + "."
        question, qprefix, answer = " Repeat the list.", " The list is:", listing
        facts = []
        meta = {}
    else:
        head, question, qprefix, answer = "", "", "", ""
        meta = {}
    if chat:
        # The user turn holds the context and question; the assistant answers in a full sentence.
        pre = ["<|start_header_id|>user<|end_header_id|>\n\n" + head]
        q_segs = [question, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]
        answer_head, tail = qprefix.lstrip(), ["<|eot_id|>"]
    else:
        pre = [head] if head else []
        q_segs = [question, qprefix] if question else []
        answer_head, tail = "", []
    if task == "continue":
        segs, ids = builder.haystack(rng, cast, length - 1, lead_space=False, style=style)
        text = "".join(segs)
        return text, [builder.bos] + ids, "", [], meta
    fixed = pre + [f for _, f in facts] + q_segs
    fixed_ids = builder.many(fixed)
    ans_ids = (builder.ids(answer_head) if answer_head else []) + builder.ids(answer) + builder.ids(".") + \
        [builder.tok.token_to_id(s) for s in tail]
    n_fixed = sum(len(x) for x in fixed_ids)
    n_hay = max(0, length - 1 - n_fixed - len(ans_ids))
    h_segs, h_ids = builder.haystack(rng, cast, n_hay, style=style)
    # Split the haystack at sentence boundaries by depth; facts go in at their depths.
    bounds = [0]
    for s in h_segs:
        bounds.append(bounds[-1] + len(builder.ids(s)))
    total = bounds[-1]
    out_segs, out_ids = [], [builder.bos]
    for s, e in zip(pre, fixed_ids[: len(pre)]):
        out_segs.append(s)
        out_ids.extend(e)
    fi = 0
    fact_ids = fixed_ids[len(pre): len(pre) + len(facts)]
    order = sorted(range(len(facts)), key=lambda i: facts[i][0])
    for si, s in enumerate(h_segs + [None]):
        while fi < len(order) and (s is None or bounds[si] >= facts[order[fi]][0] * total):
            out_segs.append(facts[order[fi]][1])
            out_ids.extend(fact_ids[order[fi]])
            fi += 1
        if s is None:
            break
        out_segs.append(s)
        out_ids.extend(builder.ids(s))
    for s, e in zip(q_segs, fixed_ids[len(pre) + len(facts):]):
        out_segs.append(s)
        out_ids.extend(e)
    meta["chat"] = chat
    meta["style"] = style
    return "".join(out_segs), out_ids, answer_head + answer, ans_ids, meta


def check_segment_concat(builder: Builder, rng: random.Random, n: int = 50) -> int:
    """How many of n random samples tokenize differently whole than by segments (want 0)."""
    bad = 0
    for i in range(n):
        task = ("passkey", "needle", "multikey", "continue")[i % 4]
        text, ids, answer, _, _ = build(builder, rng, task, rng.choice([200, 700, 1500]), chat=(i % 3 == 0))
        whole = builder.tok.encode(text, add_special_tokens=True).ids
        if whole != ids:
            bad += 1
        if answer:
            whole2 = builder.tok.encode(text + answer + ".", add_special_tokens=True).ids
            if whole2[: len(ids)] != ids:
                bad += 1
    return bad
