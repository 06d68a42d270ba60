"""How many guesses a typed cluster token is worth: zxcvbn, less what it cannot see.

zxcvbn estimates English text well (dictionary words, names, repeats, sequences, keyboard
walks, dates) and other text badly: its dictionaries are English, so a famous sentence it
does not know, a hash of a common password and text in another script all read to it as
random characters (issue 39: "the quick brown fox...", Lorem ipsum, "Мама мыла раму" and
sha256("password") scored 106-209 bits). An attacker guesses those first. So before zxcvbn
sees a token:

- a hex or base64 digest (md5, sha1, sha2) of a word of zxcvbn's own lists (30,000 common
  passwords, English words, names) or of a well-known text is refused outright;
- runs of three or more words of a well-known text (:data:`WELL_KNOWN_TEXTS`: pangrams,
  Lorem ipsum, famous opening lines and quotes, primer sentences) are credited only with the
  choice of text and where the run starts;
- each word holding letters outside ASCII is credited :data:`FOREIGN_WORD_GUESSES_LOG10`
  (one of 100 common words), however long: a conservative floor, since no
  estimate of other languages is at hand; ``potluck token`` makes a token that needs none.

zxcvbn scores what is left; the parts' guesses multiply (their logarithms add).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import re
from dataclasses import dataclass

from zxcvbn import zxcvbn
from zxcvbn.frequency_lists import FREQUENCY_LISTS

FOREIGN_WORD_GUESSES_LOG10 = 2.0  # about 7 bits a word outside ASCII: one of 100 common words
MIN_RUN_WORDS = 3  # fewer words in common with a well-known text are left to zxcvbn

# Lower case, words only (punctuation does not matter: tokens are split into words).
WELL_KNOWN_TEXTS: tuple[str, ...] = (
    # pangrams and typing drills
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz judge my vow",
    "jackdaws love my big sphinx of quartz",
    "how vexingly quick daft zebras jump",
    "the five boxing wizards jump quickly",
    "waltz bad nymph for quick jigs vex",
    "now is the time for all good men to come to the aid of the party",
    "all work and no play makes jack a dull boy",
    "correct horse battery staple",
    "hello world",
    # Lorem ipsum and its source
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et "
    "dolore magna aliqua ut enim ad minim veniam quis nostrud exercitation ullamco laboris nisi ut aliquip ex "
    "ea commodo consequat duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu "
    "fugiat nulla pariatur excepteur sint occaecat cupidatat non proident sunt in culpa qui officia deserunt "
    "mollit anim id est laborum",
    "neque porro quisquam est qui dolorem ipsum quia dolor sit amet consectetur adipisci velit",
    # famous lines
    "to be or not to be that is the question whether tis nobler in the mind to suffer the slings and arrows "
    "of outrageous fortune or to take arms against a sea of troubles",
    "it was the best of times it was the worst of times",
    "it is a truth universally acknowledged that a single man in possession of a good fortune must be in "
    "want of a wife",
    "all happy families are alike each unhappy family is unhappy in its own way",
    "call me ishmael",
    "in the beginning god created the heaven and the earth",
    "in the beginning was the word and the word was with god and the word was god",
    "the lord is my shepherd i shall not want",
    "our father which art in heaven hallowed be thy name",
    "four score and seven years ago our fathers brought forth on this continent a new nation",
    "we hold these truths to be self evident that all men are created equal",
    "i have a dream",
    "one small step for man one giant leap for mankind",
    "ask not what your country can do for you ask what you can do for your country",
    "a long time ago in a galaxy far far away",
    "may the force be with you",
    "to infinity and beyond",
    "houston we have a problem",
    "the answer to life the universe and everything",
    "i think therefore i am",
    "a journey of a thousand miles begins with a single step",
    "the rain in spain stays mainly in the plain",
    "mary had a little lamb its fleece was white as snow",
    "twinkle twinkle little star how i wonder what you are",
    "humpty dumpty sat on a wall humpty dumpty had a great fall",
    "jack and jill went up the hill to fetch a pail of water",
    "row row row your boat gently down the stream",
    "the cat sat on the mat",
    "veni vidi vici",
    "carpe diem",
    # other languages: pangrams and primer sentences
    "мама мыла раму",
    "съешь же ещё этих мягких французских булок да выпей же чаю",
    "в чащах юга жил бы цитрус да но фальшивый экземпляр",
    "franz jagt im komplett verwahrlosten taxi quer durch bayern",
    "victor jagt zwölf boxkämpfer quer über den großen sylter deich",
    "portez ce vieux whisky au juge blond qui fume",
    "voix ambiguë d un cœur qui au zéphyr préfère les jattes de kiwis",
    "el veloz murciélago hindú comía feliz cardillo y kiwi",
    "la cigüeña tocaba el saxofón detrás del palenque de paja",
    "quel fez sghembo copre davanti",
    "pchnąć w tę łódź jeża lub ośm skrzyń fig",
    "いろはにほへと ちりぬるを",
    "天地玄黄 宇宙洪荒",
)

_WORD = re.compile(r"\w+", re.UNICODE)
_DIGESTS = {32: ("md5",), 40: ("sha1",), 56: ("sha224",), 64: ("sha256", "sha3_256"), 96: ("sha384",),
            128: ("sha512",)}


@dataclass(frozen=True)
class Estimate:
    """log10 of the guesses a token needs, and why it is worth less than it looks (or "")."""

    guesses_log10: float
    why: str = ""


def _words(text: str) -> list[str]:
    return [w.casefold().replace("ё", "е") for w in _WORD.findall(text)]


@functools.lru_cache(maxsize=1)
def _known() -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(_words(t)) for t in WELL_KNOWN_TEXTS)


@functools.lru_cache(maxsize=8)
def _common_digests(algorithm: str) -> frozenset[bytes]:
    """The digests of every word zxcvbn's lists hold, and of every well-known text."""
    words = {w for ranked in FREQUENCY_LISTS.values() for w in ranked}
    texts = set(WELL_KNOWN_TEXTS) | {" ".join(t) for t in _known()}
    return frozenset(hashlib.new(algorithm, s.encode("utf-8")).digest() for s in words | texts)


def digest_of_common_text(body: str) -> str:
    """The algorithm whose hex or base64 digest ``body`` is, of a common password, word,
    name or well-known text ("" if none)."""
    body = body.strip()
    raw: bytes | None = None
    if re.fullmatch(r"[0-9a-fA-F]+", body) and len(body) in _DIGESTS:
        raw = bytes.fromhex(body)
    elif re.fullmatch(r"[A-Za-z0-9+/]+={0,2}", body) and ("=" in body or "+" in body or "/" in body):
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
        except ValueError:
            raw = None
    if raw is None or len(raw) * 2 not in _DIGESTS:
        return ""
    for algorithm in _DIGESTS[len(raw) * 2]:
        if raw in _common_digests(algorithm):
            return algorithm
    return ""


def _known_runs(words: list[str]) -> tuple[set[int], int]:
    """Indexes of ``words`` inside runs of at least :data:`MIN_RUN_WORDS` consecutive words of
    one well-known text (a whole text when it is shorter), and how many runs."""
    marked: set[int] = set()
    runs = 0
    for text in _known():
        need = min(MIN_RUN_WORDS, len(text))
        i = 0
        while i < len(words):
            best = 0
            for j in range(len(text)):
                k = 0
                while i + k < len(words) and j + k < len(text) and words[i + k] == text[j + k]:
                    k += 1
                best = max(best, k)
            if best >= need:
                marked.update(range(i, i + best))
                runs += 1
                i += best
            else:
                i += 1
    return marked, runs


def estimate(body: str, scored_chars: int) -> Estimate:
    """The guesses a token body (what follows the public ``potluck-`` prefix) is worth; only
    its first ``scored_chars`` are scored (zxcvbn's time grows with the square of the length,
    and guessing a token means guessing its start too, so the start's estimate is a lower
    bound), though a digest is recognized whole."""
    algorithm = digest_of_common_text(body)
    if algorithm:
        return Estimate(0.0, f"it is the {algorithm} of a common password or text")
    body = body[:scored_chars]
    spans = [(m.start(), m.end()) for m in _WORD.finditer(body)]
    words = _words(body)
    marked, runs = _known_runs(words)
    foreign = [i for i, w in enumerate(words) if i not in marked and not w.isascii()]
    removed = sorted({*marked, *foreign})
    rest, last = [], 0
    for i in removed:
        rest.append(body[last:spans[i][0]])
        last = spans[i][1]
    rest.append(body[last:])
    remainder = " ".join(part.strip() for part in rest if part.strip())
    guesses = float(zxcvbn(remainder, max_length=scored_chars)["guesses_log10"]) if remainder else 0.0
    guesses += runs * math.log10(len(WELL_KNOWN_TEXTS) * 100) + len(foreign) * FOREIGN_WORD_GUESSES_LOG10
    why = []
    if runs:
        why.append("it holds a well-known text")
    if foreign:
        why.append(f"words outside ASCII count as common words ({FOREIGN_WORD_GUESSES_LOG10 * math.log2(10):.0f} "
                   "bits each)")
    return Estimate(guesses, "; ".join(why))
