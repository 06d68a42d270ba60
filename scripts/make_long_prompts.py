"""Write ``assets/prompts/long.txt``: the long-context bench family (no network, deterministic).

Each document is the chronicle of a fictional harbour town, generated from a seeded
``random.Random`` and fixed word lists, with one detail planted in the middle (a code word,
a date and a name). For each size (about 2K, 4K and 8K tokens of the bundled model's
tokenizer, the last one leaving room for a reply within its 8,192-token training length) the
family holds a summarization prompt and a question about that detail.

    .venv/bin/python scripts/make_long_prompts.py            # rewrite the shipped file
    .venv/bin/python scripts/make_long_prompts.py --check    # token counts of each prompt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "assets" / "prompts" / "long.txt"
# words per document: ~1.3 tokens per word for this text with the SmolLM2 tokenizer
SIZES = {"2K": 1_450, "4K": 2_950, "8K": 5_600}

PEOPLE = ["Mara Olsen", "Tomas Reyes", "Ingrid Bauer", "Samuel Okafor", "Lena Novak", "Pieter de Vries",
          "Aiko Tanaka", "Rosa Delgado", "Henrik Lund", "Amara Diallo", "Jonas Weber", "Clara Moreau"]
ROLES = ["the harbour master", "the mayor", "the schoolteacher", "the baker", "the lighthouse keeper",
         "the ferry captain", "the town doctor", "the librarian", "the net maker", "the customs officer"]
PLACES = ["the north pier", "the fish market", "the old chapel", "the salt warehouse", "the town square",
          "the lighthouse", "the boatyard", "the customs house", "the east road", "the library"]
THINGS = ["a new crane", "twelve fishing boats", "a shipment of timber", "the winter stores", "a bronze bell",
          "the harbour wall", "a steam engine", "the school roof", "two hundred barrels of herring",
          "a printing press"]
EVENTS = ["a storm damaged", "the council voted to repair", "merchants from the south brought",
          "a fire destroyed", "the guild paid for", "volunteers rebuilt", "the town celebrated",
          "the harbour master inspected", "a long frost delayed work on", "the people of the valley sold"]
MOODS = ["Most people agreed that it was a good year.", "Prices rose and many families struggled.",
         "The harvest was poor, but the fishing was rich.", "Trade with the islands grew steadily.",
         "The winter was long and the harbour froze for six weeks.",
         "Several families left for the city, and few came back."]
NEEDLE = ("In the spring of {year}, {person}, {role}, chose the secret code word \"{word}\" for the "
          "signal lamps of the lighthouse and wrote it in the ledger kept at {place}.")
WORDS = ["amberwick", "saltmoor", "quillstone", "harrowlight", "greyfen"]


def chronicle(words: int, seed: int) -> tuple[str, str]:
    """A document of about ``words`` words and the question about its planted detail."""
    rng = random.Random(seed)
    year = 1700
    paragraphs: list[str] = []
    count = 0
    needle_at = words // 2
    question = ""
    while count < words:
        year += rng.randint(1, 3)
        sentences = [f"In the year {year}, {rng.choice(EVENTS)} {rng.choice(THINGS)} near {rng.choice(PLACES)}."]
        for _ in range(rng.randint(2, 4)):
            verb = rng.choice(["spoke", "wrote", "complained", "reported"])
            sentences.append(
                f"{rng.choice(PEOPLE)}, {rng.choice(ROLES)}, {verb} about {rng.choice(THINGS)} at {rng.choice(PLACES)}."
            )
        sentences.append(rng.choice(MOODS))
        if not question and count >= needle_at:
            person, role, word, place = rng.choice(PEOPLE), rng.choice(ROLES), rng.choice(WORDS), rng.choice(PLACES)
            sentences.insert(1, NEEDLE.format(year=year, person=person, role=role, word=word, place=place))
            question = (f"According to the chronicle, which code word did {person} choose for the signal lamps "
                        f"of the lighthouse, in which year, and where was it written down?")
        text = " ".join(sentences)
        paragraphs.append(text)
        count += len(text.split())
    return "\n\n".join(paragraphs), question


def prompts() -> list[tuple[str, str]]:
    """(label, prompt) pairs: for each size a summary and a question about the middle."""
    out = []
    for i, (label, words) in enumerate(SIZES.items()):
        doc, question = chronicle(words, seed=11 + i)
        out.append((f"{label} summary", f"Read the chronicle below, then summarize it in a few sentences.\n\n{doc}"))
        out.append((f"{label} question", f"Read the chronicle below, then answer the question after it.\n\n{doc}\n\n"
                                          f"Question: {question}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print each prompt's token count instead of writing")
    args = ap.parse_args()
    pairs = prompts()
    if args.check:
        from potluck.assets import default_model_path
        from potluck.engine.core.runtime import Model
        from potluck.engine.lab.benchmark import chat_prompt_tokens

        with Model(default_model_path(), vocab_only=True) as model:
            for label, text in pairs:
                print(f"{label}: {len(chat_prompt_tokens(model, text))} tokens")
        return
    head = ("# Long contexts: chronicles of about 2K, 4K and 8K tokens (scripts/make_long_prompts.py),\n"
            "# each summarized and asked about a detail planted in the middle. Run with --ctx 8192.\n"
            "# Prompts are separated by lines holding only \"%%\".\n")
    OUT.write_text(head + "\n%%\n".join(text for _, text in pairs) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
