"""Synthetic chat prompts for the output-length predictor's training data (no download, no licence).

``python bench/data/synthetic.py [--num N] [--seed S]`` writes ``bench/data/synthetic.jsonl``:
one ``{"id", "prompt", "kind"}`` object per line, built from templates over small word lists,
so its answers span the lengths real chat traffic has: one-word and yes/no answers, short
factual questions, arithmetic, definitions, a few sentences, lists, step-by-step guides,
code, essays and stories. The same ``--num`` and ``--seed`` always give the same file (ids
are ``synthetic/<kind>/<n>``), which is how ``bench/data/predictor_lengths*.csv`` rows, tied to
prompts by ``(dataset, id, prompt_sha256)``, stay reproducible.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

COUNTRIES = ("France", "Japan", "Brazil", "Kenya", "Canada", "Egypt", "Norway", "India", "Mexico", "Australia",
             "Germany", "Peru", "Vietnam", "Italy", "Chile", "Spain", "Turkey", "Poland", "Ghana", "Thailand",
             "Argentina", "Sweden", "Morocco", "Greece", "Portugal", "Nigeria", "Ireland", "Cuba", "Nepal", "Iceland")
SCIENCE = ("photosynthesis", "gravity", "entropy", "evolution", "plate tectonics", "the water cycle", "DNA replication",
           "black holes", "quantum entanglement", "the greenhouse effect", "vaccines", "electricity", "magnetism",
           "the immune system", "nuclear fusion", "continental drift", "osmosis", "inflation in economics",
           "supply and demand", "machine learning", "public-key cryptography", "the stock market", "recursion",
           "blockchain", "climate change", "the Doppler effect", "antibiotic resistance", "the Big Bang",
           "natural selection", "compound interest", "neural networks", "the French Revolution", "democracy",
           "the Renaissance", "the Industrial Revolution", "tides", "earthquakes", "volcanoes", "rainbows", "sleep")
TOPICS = ("the importance of reading", "remote work", "social media and teenagers", "space exploration",
          "renewable energy", "the future of cities", "learning a second language", "artificial intelligence",
          "friendship", "the value of failure", "public libraries", "electric cars", "online education",
          "protecting the oceans", "the history of the internet", "video games", "healthy eating", "music",
          "travel", "volunteering", "minimalism", "the role of art in society", "privacy", "urban gardening",
          "sports in schools", "the four-day work week", "climate change", "kindness", "mountains", "coffee")
ACTIVITIES = ("learning to cook", "running a marathon", "saving money", "studying for an exam", "starting a garden",
              "learning to code", "public speaking", "sleeping better", "writing a resume", "training a puppy",
              "reducing stress", "learning guitar", "moving to a new city", "planning a wedding", "hiking safely",
              "staying productive at home", "making friends as an adult", "buying a used car", "baking bread",
              "preparing for a job interview", "keeping houseplants alive", "learning to swim", "meditating",
              "organizing a closet", "camping in the rain")
THINGS = ("fruits", "programming languages", "musical instruments", "board games", "European capitals",
          "famous painters", "ocean animals", "breakfast ideas", "hobbies", "careers in science", "birds",
          "classic novels", "ways to save energy", "team-building activities", "vegetables", "sports",
          "inventions of the 20th century", "movie genres", "types of clouds", "healthy snacks")
CODE_TASKS = ("reverses a string", "checks whether a number is prime", "computes the nth Fibonacci number",
              "sorts a list with merge sort", "counts the words in a text", "finds the largest element of a list",
              "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
              "removes duplicates from a list", "computes the factorial of n", "flattens a nested list",
              "merges two sorted lists", "implements binary search", "parses a CSV line",
              "returns the most common character in a string", "validates an email address",
              "implements a stack class", "computes the greatest common divisor", "transposes a matrix",
              "reads a file and prints its lines in reverse")
LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "Java")
WORDS = ("house", "water", "friend", "book", "sun", "happy", "tree", "school", "dog", "bread", "night", "love",
         "city", "window", "river", "music", "apple", "rain", "road", "star")
TARGET_LANGS = ("French", "Spanish", "German", "Italian", "Portuguese")
CHARACTERS = ("a lighthouse keeper", "a robot who wants to paint", "a lost cat", "a young wizard", "a time traveller",
              "an old fisherman", "a girl who can talk to birds", "a detective in Paris", "a dragon afraid of fire",
              "two rival chefs", "an astronaut on Mars", "a shy giant", "a talking tree", "a pirate who hates the sea",
              "a librarian with a secret")
ANIMALS = ("elephant", "octopus", "penguin", "cheetah", "owl", "dolphin", "bee", "giraffe", "wolf", "tortoise")
PEOPLE = ("Albert Einstein", "Marie Curie", "Leonardo da Vinci", "Isaac Newton", "Ada Lovelace", "Nelson Mandela",
          "William Shakespeare", "Cleopatra", "Charles Darwin", "Mahatma Gandhi", "Frida Kahlo", "Alan Turing")


def _templates(rng: random.Random) -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs of every template family, each family's draws shuffled by ``rng``."""
    c, s, t, a = rng.choice(COUNTRIES), rng.choice(SCIENCE), rng.choice(TOPICS), rng.choice(ACTIVITIES)
    x, y = rng.randint(2, 999), rng.randint(2, 999)
    n = rng.choice((3, 5, 7, 10))
    word, lang = rng.choice(WORDS), rng.choice(TARGET_LANGS)
    return [
        ("oneword", f"What is the capital of {c}? Answer with one word."),
        ("oneword", f"Translate the word '{word}' into {lang}. Reply with the word only."),
        ("oneword", f"Is {x} an even number? Answer yes or no."),
        ("oneword", f"What continent is {c} in? One word, please."),
        ("short", f"What is {x} + {y}?"),
        ("short", f"What is {x} times {rng.randint(2, 20)}?"),
        ("short", f"What is the capital of {c}?"),
        ("short", f"Who was {rng.choice(PEOPLE)}?"),
        ("short", f"How many legs does a {rng.choice(ANIMALS)} have?"),
        ("short", f"Give me a synonym for '{rng.choice(('happy', 'big', 'fast', 'smart', 'cold', 'angry'))}'."),
        ("short", f"In one sentence, what is {s}?"),
        ("short", f"What language do people speak in {c}?"),
        ("medium", f"Explain {s} in two or three sentences."),
        ("medium", f"Define {s} for a ten-year-old."),
        ("medium", f"Give me three tips for {a}."),
        ("medium", f"Write a haiku about {rng.choice(TOPICS)}."),
        ("medium", f"Summarize the main idea of {s} in a short paragraph."),
        ("medium", f"What are the pros and cons of {t}?"),
        ("list", f"List {n} {rng.choice(THINGS)}."),
        ("list", f"Name {n} facts about {c}."),
        ("list", f"List {n} interesting facts about the {rng.choice(ANIMALS)}."),
        ("list", f"Give me a list of {n} ideas for {a}."),
        ("long", f"Write a step-by-step guide to {a}."),
        ("long", f"Explain {s} in detail, with examples."),
        ("long", f"Write an essay about {t}."),
        ("long", f"Write a long story about {rng.choice(CHARACTERS)}."),
        ("long", f"Write a detailed travel guide for a week in {c}."),
        ("long", f"Describe the life and work of {rng.choice(PEOPLE)} in detail."),
        ("code", f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}."),
        ("code", f"Write a {rng.choice(LANGUAGES)} program that {rng.choice(CODE_TASKS)}, and explain how it works."),
        ("code", f"What does a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)} look like? Show only the code."),
    ]


def synthetic_prompts(num: int, seed: int = 0) -> list[dict[str, str]]:
    """``num`` distinct synthetic prompts, round-robin over the template families (deterministic)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    counts: dict[str, int] = {}
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num:
            raise ValueError(f"the templates give fewer than {num} distinct prompts")
        for kind, prompt in _templates(rng):
            if prompt in seen or len(out) >= num:
                continue
            seen.add(prompt)
            counts[kind] = counts.get(kind, 0) + 1
            out.append({"id": f"synthetic/{kind}/{counts[kind]}", "prompt": prompt, "kind": kind})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "synthetic.jsonl")
    args = parser.parse_args(argv)
    records = synthetic_prompts(args.num, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"synthetic: wrote {len(records)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
