"""Endless varied English text, cut to exact token counts of the model's tokenizer.

Prompts made of real words tokenize the way user text does (about 1.3 tokens a word), unlike
random token ids, which decode to byte soup and re-tokenize to a different length. Sentences
come from templates over word lists, so two prompts never share more than a few leading
tokens: a prefix cache only hits where a dataset shares a prefix on purpose.
"""

from __future__ import annotations

import random

import tokenizers


def _words(text: str) -> list[str]:
    return text.split()


ADJECTIVES = _words("""ancient bright quiet restless golden narrow hidden patient careful
distant frozen gentle heavy hollow honest humble idle jagged lonely loyal modest noisy open pale
proud rapid rough rusty silent simple sleepy slow smooth soft sturdy sudden swift tall tender
tired vast warm wild wise wooden young bitter brave calm clever crooked curious eager empty
faint fierce fragile generous gloomy graceful hasty merry nervous peaceful polite precious
rare ripe sacred scarlet shallow sharp shy steep strange stubborn sweet thick thin vivid weary""")
NOUNS = _words("""river harbor mountain village garden forest window lantern traveler merchant
farmer sailor teacher doctor painter soldier kingdom castle bridge market library orchard
valley meadow island desert storm winter summer morning evening letter journey engine
machine clock mirror candle kettle blanket basket ladder wagon carriage ship anchor compass
map road path tower chapel cottage field fountain well barn mill stable courtyard wall gate
stone feather thread needle hammer violin piano song story promise secret question answer
lesson silence memory dream shadow cloud moon star ocean shore wave tide breeze fire smoke
ash seed root branch leaf blossom apple bread cheese honey tea coffee council captain widow
child grandmother neighbor stranger scholar poet judge clerk baker weaver blacksmith""")
VERBS = _words("""carried followed watched opened closed painted crossed repaired visited
remembered forgot described measured gathered scattered guarded welcomed answered
questioned studied borrowed returned admired ignored mended polished counted traded shared
hid found lost built burned planted harvested sold bought wrote read sang heard saw noticed
praised doubted chased warned greeted trusted carved lifted dropped pulled pushed""")
ADVERBS = _words("""slowly quickly quietly carefully gladly barely suddenly gently eagerly
rarely often always never patiently proudly softly boldly calmly warmly wisely nearly""")
NAMES = _words("""Anna Thomas Clara Henry Margaret Samuel Eleanor Walter Lucy Arthur Rose
Edmund Martha George Alice Peter Helen Oliver Jane Frederick Agnes Daniel Ruth Hugo Emma""")
PLACES = [
    "near the old bridge",
    "beyond the northern hills",
    "inside the crowded market",
    "along the muddy road",
    "under the tall oak",
    "behind the chapel",
    "across the frozen lake",
    "at the edge of the forest",
    "in the small kitchen",
    "on the windy shore",
    "by the broken fountain",
    "through the narrow streets",
    "above the sleeping village",
    "beside the river",
    "within the castle walls",
]
TIMES = [
    "that morning",
    "in the spring",
    "before dawn",
    "late one evening",
    "every winter",
    "the next day",
    "long ago",
    "during the harvest",
    "at noon",
    "by the end of the year",
]
CONNECTORS = ["and", "but", "while", "because", "although", "so", "until", "after"]

# Each template is filled from the word lists; {A} adjective, {N} noun, {V} verb, {D} adverb,
# {P} place, {M} name, {C} connector, {T} time.
TEMPLATES = [
    "The {A} {N} {V} the {A} {N} {P}.",
    "{M} {D} {V} a {A} {N} {T}.",
    "{T}, the {N} {V} the {N} {C} the {A} {N} {V} it {D}.",
    "Nobody {V} the {A} {N} {P}, {C} {M} {V} it {T}.",
    "Why had the {A} {N} {V} the {N} {P}?",
    "{M} said that the {N} was {A} {C} the {N} was {A}.",
    "A {A} {N} and a {A} {N} {V} each other {P}.",
    "{P}, {M} {V} the {N} {D} and {V} the {A} {N}.",
    "It was a {A} {N}, {A} and {A}, {C} everyone {V} it.",
    "The {N} of the {A} {N} {V} {D} {T}.",
    "{M} and {M} {V} the {N} {P} {C} the {N} grew {A}.",
    "Few people {V} how {A} the {N} had been {T}.",
]


def sentence(rng: random.Random) -> str:
    pick = {
        "{A}": ADJECTIVES,
        "{N}": NOUNS,
        "{V}": VERBS,
        "{D}": ADVERBS,
        "{P}": PLACES,
        "{M}": NAMES,
        "{C}": CONNECTORS,
        "{T}": TIMES,
    }
    out = rng.choice(TEMPLATES)
    for slot, words in pick.items():
        while slot in out:
            out = out.replace(slot, rng.choice(words), 1)
    return out[0].upper() + out[1:]


def paragraph(rng: random.Random, num_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(num_sentences))


class TextSource:
    """Fresh text of exact token lengths: consecutive slices of one endless generated stream,
    so no two slices share a prefix. Deterministic for a given tokenizer and seed."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self._ids: list[int] = []
        self._pos = 0

    def token_ids(self, n: int) -> list[int]:
        while len(self._ids) - self._pos < n:
            # ~15 tokens a sentence; refill in blocks so short requests cost one encode each
            sentences = max(64, (n - len(self._ids) + self._pos) // 10)
            text = " " + paragraph(self.rng, sentences)
            self._ids = self._ids[self._pos :] + self.encode(text)
            self._pos = 0
        out = self._ids[self._pos : self._pos + n]
        self._pos += n
        return out

    def text(self, n: int) -> str:
        """About `n` tokens of text: exactly n before decoding, within a token or two after
        the server re-tokenizes it (the cut points may merge differently)."""
        return self.tokenizer.decode(self.token_ids(n), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
