"""An offline source of varied natural prompts for drafter training (no download needed).

Disjoint splits, built from different material or different template families (see PROMPTS.md):

- ``train``: explain / use / summarise Python standard-library modules, functions and classes (docstrings read from
  the installed stdlib sources with `ast`, nothing is imported or executed), arithmetic and algebra word problems,
  short stories, everyday chat requests and general-knowledge questions.
- ``validation``: sections of the Python language reference (`pydoc_data.topics`, shipped with CPython), and held-out
  template families (compare / rewrite / plan / percentages and fractions / dialogues) over held-out topic lists.
- ``documents``: held out as well, for tuning on copy-heavy use: longer language-reference passages to summarise,
  answer questions from, extract rules from, translate or rewrite (the regime of summarisation and RAG prompts).
- ``test``: frozen, for reporting only: chat requests and word problems of their own template families over their own
  topic lists (no prompt of another split; no checkpoint, setting or shipping choice was ever made on them). Select
  on ``validation``, report on ``test``.

Everything is deterministic for a given seed and Python version.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import pkgutil
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "PYDOC_MODULES",
    "PYDOC_SPLITS",
    "SPLITS",
    "PydocEntry",
    "WrittenBrief",
    "default_prompts",
    "pydoc_entries",
    "pydoc_prompts",
    "pydoc_question",
    "pydoc_split",
    "read_source",
    "written_briefs",
]

SPLITS = ("train", "validation", "documents", "test")

# Standard-library packages that are tests, demos, GUI toolkits or tooling rather than library material.
_SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "test",
    "unittest",
    "venv",
    "distutils",
    "msilib",
    "_pydev_bundle",
    "xxlimited",
    "xxsubtype",
    "nturl2path",
    "sre_compile",
    "sre_constants",
    "sre_parse",
    "pydoc",
    "__future__",
    "__hello__",
    "__phello__",
}
_MAX_DOC_CHARS = 900


# ---------------------------------------------------------------------------------------------------------------------
# Material: the installed standard library
# ---------------------------------------------------------------------------------------------------------------------
def _first_paragraphs(doc: str, limit: int = _MAX_DOC_CHARS) -> str:
    """Leading paragraphs of a docstring, cut at a paragraph boundary below `limit` characters."""
    out: list[str] = []
    size = 0
    for para in doc.strip().split("\n\n"):
        para = para.strip()
        if not para:
            continue
        if out and size + len(para) > limit:
            break
        out.append(para[:limit])
        size += len(para)
    return "\n\n".join(out)


def read_source(path: str | None) -> str | None:
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def stdlib_modules() -> list[tuple[str, str]]:
    """(dotted name, source file) of the installed pure-Python stdlib modules and their submodules, sorted.

    Found with import-system finders only: no module is imported or executed.
    """
    found: list[tuple[str, str]] = []
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in _SKIP_MODULES:
            continue
        try:
            spec = importlib.util.find_spec(name)  # top-level names: nothing is imported
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        found.append((name, spec.origin))
        # one level of submodules (found with the package's own finder: pkgutil.walk_packages would import them)
        for info in sorted(pkgutil.iter_modules(list(spec.submodule_search_locations or [])), key=lambda m: m.name):
            if info.name.startswith("_") or info.name in ("test", "tests"):
                continue
            sub = info.module_finder.find_spec(info.name)
            if sub is not None and sub.origin and sub.origin.endswith(".py"):
                found.append((f"{name}.{info.name}", sub.origin))
    return found


def _entries_of(module: str, source: str) -> list[tuple[str, str, str, str]]:
    """(module, object, kind, docstring) for the documented public module, functions, classes and methods."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    entries = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) > 40:
        entries.append((module, "", "module", _first_paragraphs(doc)))
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc and len(doc) >= 30:
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            entries.append((module, node.name, kind, _first_paragraphs(doc)))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    doc = ast.get_docstring(item)
                    if doc and len(doc) >= 30:
                        entries.append((module, f"{node.name}.{item.name}", "method", _first_paragraphs(doc)))
    return entries


def _language_reference(limit: int = _MAX_DOC_CHARS) -> list[tuple[str, str]]:
    """(topic, text) sections of the Python language reference shipped with CPython (`pydoc_data.topics`), each cut
    to its leading paragraphs (at most about `limit` characters)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        return []
    return [(name, _first_paragraphs(text, limit)) for name, text in sorted(topics.items()) if len(text) > 200]


# ---------------------------------------------------------------------------------------------------------------------
# Train families
# ---------------------------------------------------------------------------------------------------------------------
_STDLIB_MODULE_TEMPLATES = (
    "What is the Python `{m}` module used for? Give two typical use cases.",
    "Summarise the following description of Python's `{m}` module in two sentences:\n\n{doc}",
    "I am new to Python. Explain in simple words what the standard library module `{m}` does.",
    "Write a short Python script that demonstrates the `{m}` module.",
)
_STDLIB_OBJECT_TEMPLATES = (
    "Explain what `{m}.{o}` does in Python, then show a small example.",
    "Write a Python function that uses `{m}.{o}` and explain each line.",
    "Here is the documentation of the Python {kind} `{m}.{o}`:\n\n{doc}\n\nSummarise it in plain English.",
    "Read this docstring and write a usage example for `{m}.{o}`:\n\n{doc}",
    "When would I use `{m}.{o}` instead of writing the code myself?",
    "What are the parameters of `{m}.{o}` and what does it return?",
)


def _stdlib_prompts(rng: random.Random) -> Iterator[str]:
    modules = stdlib_modules()
    rng.shuffle(modules)
    pool: list[tuple[str, str, str, str]] = []
    while modules or pool:
        while modules and len(pool) < 64:  # parse lazily, a few modules at a time, and mix their entries
            module, path = modules.pop()
            source = read_source(path)
            pool.extend(_entries_of(module, source) if source is not None else [])
        if not pool:
            continue
        module, obj, kind, doc = pool.pop(rng.randrange(len(pool)))
        if kind == "module":
            template = rng.choice(_STDLIB_MODULE_TEMPLATES)
            yield template.format(m=module, doc=doc)
        else:
            template = rng.choice(_STDLIB_OBJECT_TEMPLATES)
            yield template.format(m=module, o=obj, kind=kind, doc=doc)


_NAMES = ("Ada", "Bilal", "Chen", "Dana", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Mateo")
_ITEMS = ("apples", "books", "pencils", "tickets", "stamps", "marbles", "cookies", "plants", "coins", "shirts")


def _math_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        a, b, c = rng.randint(2, 99), rng.randint(2, 60), rng.randint(2, 30)
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        kind = rng.randrange(7)
        if kind == 0:
            yield f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} are left?"
        elif kind == 1:
            yield f"Solve for x: {a}x + {b} = {a * c + b}. Show your steps."
        elif kind == 2:
            yield f"What is {a} multiplied by {b}? Explain how to compute it without a calculator."
        elif kind == 3:
            yield f"A car travels {a * c} km in {c} hours. What is its average speed in km/h?"
        elif kind == 4:
            yield f"Is {a * b + 1} a prime number? Explain your reasoning."
        elif kind == 5:
            yield f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?"
        else:
            yield f"{name} saves {b} dollars every week. How many weeks does it take to save {b * c} dollars?"


_CHARACTERS = (
    "a lighthouse keeper",
    "a young robot",
    "a retired astronaut",
    "a street musician",
    "a curious cat",
    "a baker",
    "a lost dragon",
    "two rival chess players",
    "a librarian",
    "a night-shift nurse",
    "a shy inventor",
    "an old fisherman",
    "a twelve-year-old detective",
    "a talking fox",
)
_SITUATIONS = (
    "finds a mysterious map",
    "has to fix a broken machine before dawn",
    "learns to paint",
    "makes an unlikely friend",
    "must keep a promise",
    "gets lost",
    "discovers a hidden talent",
    "receives a letter from the future",
    "loses their voice",
    "has one day to win a competition",
    "finds a door that was not there yesterday",
    "starts over",
)
_PLACES = (
    "a small coastal village",
    "a space station",
    "a desert town",
    "a rainy city",
    "a mountain hut",
    "an old train",
    "a busy market",
    "a forest school",
    "a floating island",
    "a snowed-in hotel",
)


def _story_prompts(rng: random.Random) -> Iterator[str]:
    forms = (
        "Write a short story about {c} who {s}, set in {p}.",
        "Tell me a bedtime story about {c} who {s} in {p}.",
        "Write a poem about {c} who {s}. The scene is {p}.",
        "Write the opening paragraph of a novel set in {p}, where {c} {s}.",
    )
    while True:
        yield rng.choice(forms).format(c=rng.choice(_CHARACTERS), s=rng.choice(_SITUATIONS), p=rng.choice(_PLACES))


_ACTIVITIES = (
    "learning a new language",
    "running a first marathon",
    "cooking for a large group",
    "studying for exams",
    "working from home",
    "saving money",
    "starting a vegetable garden",
    "sleeping better",
    "public speaking",
    "moving to a new city",
    "keeping a journal",
    "learning to code",
    "taking better photos",
    "reading more books",
    "training a puppy",
    "learning the guitar",
    "negotiating a salary",
    "making friends as an adult",
    "eating healthier",
    "travelling alone",
)
_TASKS = (
    "make a good cup of coffee",
    "change a bicycle tyre",
    "write a cover letter",
    "organise my week",
    "back up my files",
    "prepare for a job interview",
    "clean a cast-iron pan",
    "plan a birthday party",
    "bake sourdough bread",
    "set up a home Wi-Fi network",
    "start running",
    "write a good resume",
    "remove a coffee stain",
    "learn to juggle",
    "choose a laptop",
    "stop procrastinating",
    "make a budget spreadsheet",
    "care for a cactus",
    "fold a fitted sheet",
    "start a podcast",
)
_RECIPIENTS = ("my landlord", "a colleague", "my manager", "a customer", "my neighbour", "a teacher")
_EMAIL_TOPICS = (
    "a delayed delivery",
    "a schedule change",
    "a broken heater",
    "a thank-you for their help",
    "a meeting request",
    "a missed deadline",
)


_OPENERS = ("", "Hi! ", "Quick question: ", "Could you help me? ", "Please help: ", "I have a question. ")


def _chat_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        kind = rng.randrange(6)
        if kind == 0:
            request = f"Give me {rng.choice(('three', 'five', 'a few'))} tips for {rng.choice(_ACTIVITIES)}."
        elif kind == 1:
            request = f"How do I {rng.choice(_TASKS)}?"
        elif kind == 2:
            request = f"Write a polite email to {rng.choice(_RECIPIENTS)} about {rng.choice(_EMAIL_TOPICS)}."
        elif kind == 3:
            request = f"I want to get better at {rng.choice(_ACTIVITIES)}. Can you make me a simple plan?"
        elif kind == 4:
            request = f"What mistakes do beginners make when {rng.choice(_ACTIVITIES)}?"
        else:
            request = f"My friend wants to {rng.choice(_TASKS)}. What should they know first?"
        yield rng.choice(_OPENERS) + request


_CONCEPTS = (
    "photosynthesis",
    "gravity",
    "inflation",
    "the water cycle",
    "black holes",
    "vaccines",
    "plate tectonics",
    "the French Revolution",
    "supply and demand",
    "DNA",
    "electric circuits",
    "climate change",
    "the Roman Empire",
    "machine learning",
    "the immune system",
    "compound interest",
    "volcanoes",
    "the printing press",
    "sound waves",
    "antibiotics",
    "the stock market",
    "rainbows",
    "tides",
    "the Industrial Revolution",
    "evolution",
    "the internet",
    "nuclear energy",
    "the Silk Road",
    "earthquakes",
    "blood circulation",
    "magnetism",
    "democracy",
    "the Renaissance",
    "recycling",
    "weather forecasts",
    "coral reefs",
    "the speed of light",
    "bees and pollination",
    "taxes",
    "sleep",
)
_AUDIENCES = ("a ten-year-old", "a high-school student", "a busy adult", "someone who has never heard of it")


def _qa_prompts(rng: random.Random) -> Iterator[str]:
    forms = (
        "Explain {c} to {a}.",
        "What is {c}? Answer in one paragraph.",
        "Why is {c} important?",
        "List three surprising facts about {c}.",
        "What are common misconceptions about {c}?",
        "How would you teach {c} to {a}?",
        "Write a short summary of what scientists or historians know about {c}.",
        "Give me a one-sentence definition of {c}, then a longer explanation.",
    )
    while True:
        yield rng.choice(forms).format(c=rng.choice(_CONCEPTS), a=rng.choice(_AUDIENCES))


_CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "merges two sorted lists",
    "computes the Fibonacci numbers",
    "removes duplicates from a list",
    "finds the largest element of an array",
    "validates an email address",
    "converts Celsius to Fahrenheit",
    "reads a CSV file and sums a column",
    "implements binary search",
    "flattens a nested list",
    "checks whether a string is a palindrome",
    "computes the factorial of n",
    "sorts a list of records by age",
    "implements a stack",
    "parses a date string",
    "counts vowels in a sentence",
    "returns the n most common words",
    "rotates a matrix by 90 degrees",
    "computes the greatest common divisor",
    "implements a queue with two stacks",
    "transposes a matrix",
    "groups words that are anagrams",
    "converts a number to Roman numerals",
    "checks balanced brackets",
    "computes a moving average",
    "retries a failing operation with exponential backoff",
)
_LANGUAGES = ("Python", "JavaScript", "Rust", "Go", "C", "Java", "a Bash script", "SQL")


def _code_prompts(rng: random.Random) -> Iterator[str]:
    forms = (
        "Write a function in {l} that {t}.",
        "Show me how to write code that {t}, in {l}.",
        "Write a {l} program that {t} and add comments.",
        "Write unit tests for a function that {t} ({l}).",
    )
    while True:
        yield rng.choice(forms).format(l=rng.choice(_LANGUAGES), t=rng.choice(_CODE_TASKS))


# ---------------------------------------------------------------------------------------------------------------------
# Validation families (held out: other material, other templates, other topics)
# ---------------------------------------------------------------------------------------------------------------------
def _reference_prompts(rng: random.Random) -> Iterator[str]:
    sections = _language_reference()
    rng.shuffle(sections)
    forms = (
        "This is an excerpt of the Python language reference:\n\n{t}\n\nRewrite it as a short tutorial.",
        "In the Python language reference, what does the section on `{n}` say? Give an example.",
        "Turn this excerpt of the Python language reference into three quiz questions:\n\n{t}",
    )
    for name, text in sections:
        yield rng.choice(forms).format(n=name, t=text)


_PAIRS = (
    ("tea", "coffee"),
    ("trains", "planes"),
    ("paper books", "e-readers"),
    ("cats", "dogs"),
    ("renting", "buying a home"),
    ("solar power", "wind power"),
    ("chess", "go"),
    ("email", "phone calls"),
)
_SENTENCES = (
    "hey can u send me the file asap thx",
    "the meeting got moved again so whatever",
    "i think ur idea is kinda good but needs work",
    "pls fix the printer its broken again",
)


def _heldout_chat_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        kind = rng.randrange(4)
        if kind == 0:
            x, y = rng.choice(_PAIRS)
            yield f"Compare {x} and {y}: list the pros and cons of each."
        elif kind == 1:
            yield f'Rewrite this message in a formal tone: "{rng.choice(_SENTENCES)}"'
        elif kind == 2:
            x, y = rng.choice(_PAIRS)
            yield f"Write a short dialogue between two friends arguing about {x} versus {y}."
        else:
            days = rng.choice(("two-day", "three-day", "weekend"))
            yield f"Plan a {days} trip on a small budget, with a schedule for each day."


def _heldout_math_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        a, b = rng.randint(5, 95), rng.randint(2, 9)
        kind = rng.randrange(3)
        if kind == 0:
            yield f"What is {a}% of {b * 40}? Explain the method."
        elif kind == 1:
            yield f"Add the fractions 1/{b} and {b - 1}/{b + 3} and simplify the result."
        else:
            yield f"A shirt costs {a + 20} euros and is discounted by {b * 5}%. What is the new price?"


# ---------------------------------------------------------------------------------------------------------------------
# Test families (frozen, reporting only: templates and topics of their own)
# ---------------------------------------------------------------------------------------------------------------------
_TEST_EVENTS = (
    "moved to a new city", "lost my job", "adopted a puppy", "started university", "broke my phone screen",
    "got a parking ticket", "bought an old house", "joined a choir", "started working from home", "got engaged",
)  # fmt: skip
_TEST_OCCASIONS = (
    "a colleague's retirement", "my sister's wedding", "the opening of a community garden", "a school prize day",
    "a team's first win of the season", "a neighbour's 90th birthday", "the launch of a small bakery",
)  # fmt: skip
_TEST_DECISIONS = (
    "adopting a rabbit", "signing a phone contract", "hiring a plumber", "choosing a university course",
    "buying a used bicycle", "joining a gym", "lending money to a friend", "starting a podcast",
)  # fmt: skip
_TEST_JOBS = (
    "a lighthouse keeper", "a beekeeper", "a night-shift nurse", "a museum guide", "a ferry captain",
    "a bakery owner", "a park ranger", "a piano tuner",
)  # fmt: skip
_TEST_BUSINESSES = (
    "a bicycle repair shop", "a vegan food truck", "a dog-walking service", "a second-hand bookshop",
    "a pottery studio", "a language tutoring app", "a plant nursery",
)  # fmt: skip
_TEST_DIFFERENCES = (
    ("a virus", "a bacterium"), ("a loan", "a lease"), ("a crocodile", "an alligator"),
    ("baking soda", "baking powder"), ("a simile", "a metaphor"), ("latitude", "longitude"),
    ("weather", "climate"), ("a comet", "an asteroid"), ("a lake", "a pond"), ("a hurricane", "a tornado"),
)  # fmt: skip


_TEST_OPENERS = ("", "Hello! ", "Can you help? ", "Hi there. ")
_TEST_STYLES = ("", " Keep it short.", " Use bullet points.", " Be friendly and practical.")


def _test_chat_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        kind = rng.randrange(6)
        if kind == 0:
            request = f"I just {rng.choice(_TEST_EVENTS)}. Can you help me figure out what to do next?"
        elif kind == 1:
            request = f"Write a short speech for {rng.choice(_TEST_OCCASIONS)}."
        elif kind == 2:
            request = f"What questions should I ask before {rng.choice(_TEST_DECISIONS)}?"
        elif kind == 3:
            request = f"Describe a typical working day of {rng.choice(_TEST_JOBS)}."
        elif kind == 4:
            request = f"Suggest a name and a short slogan for {rng.choice(_TEST_BUSINESSES)}, and explain the idea."
        else:
            a, b = rng.choice(_TEST_DIFFERENCES)
            request = f"Explain the difference between {a} and {b} in simple terms."
        yield rng.choice(_TEST_OPENERS) + request + rng.choice(_TEST_STYLES)


def _test_math_prompts(rng: random.Random) -> Iterator[str]:
    while True:
        a, b, c = rng.randint(2, 12), rng.randint(3, 9), rng.randint(10, 60)
        kind = rng.randrange(3)
        if kind == 0:
            yield f"A recipe for {b} people needs {c * 10} grams of flour. How much flour is needed for {a} people?"
        elif kind == 1:
            yield f"A tank holds {c * b} litres and drains at {b} litres per minute. How long until it is empty?"
        else:
            yield f"The sides of a triangle are {a}, {b + a} and {c // 4 + a + 1} cm. What is its perimeter?"


# ---------------------------------------------------------------------------------------------------------------------
# Document families (held out; long passages the answer draws on, as in summarisation and RAG)
# ---------------------------------------------------------------------------------------------------------------------
_DOC_CHARS = 2400  # about 500-700 tokens of passage
_DOCUMENT_TEMPLATES = (
    "Summarise the following text in one paragraph:\n\n{t}",
    "Read the passage and answer the question using only the passage.\n\nPassage:\n{t}\n\n"
    "Question: what does the passage say about {n}?",
    "List the rules stated in this text, one per line, quoting it where you can:\n\n{t}",
    "Rewrite this documentation for a beginner and keep every code example:\n\n{t}",
)
_TRANSLATE_TEMPLATE = "Translate the following text into {lang}:\n\n{t}"


def _document_prompts(rng: random.Random) -> Iterator[str]:
    long_sections, short_sections = _language_reference(_DOC_CHARS), dict(_language_reference(600))
    pairs = [(i, form) for i in range(len(long_sections)) for form in range(len(_DOCUMENT_TEMPLATES) + 1)]
    rng.shuffle(pairs)
    for i, form in pairs:
        name, text = long_sections[i]
        topic = name.replace("-", " ")
        if form == len(_DOCUMENT_TEMPLATES):
            lang = rng.choice(("French", "Spanish", "German"))
            yield _TRANSLATE_TEMPLATE.format(lang=lang, t=short_sections[name])
        else:
            yield _DOCUMENT_TEMPLATES[form].format(n=topic, t=text)


# ---------------------------------------------------------------------------------------------------------------------
# Mixing
# ---------------------------------------------------------------------------------------------------------------------
_FAMILIES: dict[str, tuple[tuple[Callable[[random.Random], Iterator[str]], float], ...]] = {
    # (generator, share of the prompts); a family that runs out of material leaves its share to the others
    "train": (
        (_stdlib_prompts, 0.35),
        (_code_prompts, 0.1),
        (_math_prompts, 0.15),
        (_story_prompts, 0.15),
        (_chat_prompts, 0.125),
        (_qa_prompts, 0.125),
    ),
    "validation": (
        (_reference_prompts, 0.4),
        (_heldout_chat_prompts, 0.35),
        (_heldout_math_prompts, 0.25),
    ),
    "documents": ((_document_prompts, 1.0),),
    "test": ((_test_chat_prompts, 0.75), (_test_math_prompts, 0.25)),
}
_DEFAULT_COUNTS = {"train": 10000, "validation": 200, "documents": 100, "test": 200}
_MAX_SHARE_FACTOR = 2.0  # no family gives more than twice its share, even when others run out
_MAX_REPEATS = 2000  # consecutive duplicates after which a combinatorial family counts as exhausted


def _draw(family: Iterator[str], count: int, seen: set[str]) -> tuple[list[str], bool]:
    """Up to `count` new distinct prompts from `family`; also whether the family is exhausted."""
    out: list[str] = []
    repeats = 0
    while len(out) < count:
        prompt = next(family, None)
        if prompt is None:
            return out, True
        if prompt in seen:
            repeats += 1
            if repeats > _MAX_REPEATS:
                return out, True
            continue
        repeats = 0
        seen.add(prompt)
        out.append(prompt)
    return out, False


def default_prompts(num_prompts: int | None = None, split: str = "train", seed: int = 0) -> list[str]:
    """Up to `num_prompts` distinct prompts of `split` (see `SPLITS`), deterministic for a seed.

    Each family contributes its share; shares of families that run out of material go to the others (up to twice
    their own share). Fewer prompts than asked come back when the material runs out. Defaults: 10000 train, 200
    validation and 100 documents prompts.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown prompt split {split!r}; use one of {SPLITS}.")
    n = _DEFAULT_COUNTS[split] if num_prompts is None else int(num_prompts)
    rng = random.Random(f"moa-prompts-{split}-{seed}")
    families = [(gen(random.Random(rng.random())), share) for gen, share in _FAMILIES[split]]
    caps = [max(1, round(_MAX_SHARE_FACTOR * share * n)) for _, share in families]
    families = [(family, share, cap) for (family, share), cap in zip(families, caps)]
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n and families:
        missing, total = n - len(out), sum(share for _, share, _ in families)
        quotas = [max(1, round(missing * share / total)) for _, share, _ in families]
        still = []
        for (family, share, cap), quota in zip(families, quotas):
            got, exhausted = _draw(family, min(quota, cap, n - len(out)), seen)
            out.extend(got)
            if not exhausted and cap > len(got):
                still.append((family, share, cap - len(got)))
        families = still
    rng.shuffle(out)
    return out[:n]


# ---------------------------------------------------------------------------------------------------------------------
# Target-written material (`moa data --prompts default:written`, training only)
# ---------------------------------------------------------------------------------------------------------------------
# Templates make narrow prompts: a drafter trained on them agrees with the target on 51% of unseen prompts of the
# same families but on 32% of held-out ones (session 6). Here the target first writes free-form material (articles,
# emails, reviews, notes, user questions) from short briefs, sampled; the final prompts then ask for work on that
# material (summaries, answers from the text, replies, rewrites: the regime of summarisation and RAG) or are the
# written user questions themselves. Subjects and genres are disjoint from the validation and documents splits.
_GENRES = (
    "a short news report",
    "an encyclopedia paragraph",
    "a customer review",
    "a recipe with steps",
    "a blog post",
    "an email to a colleague",
    "the minutes of a team meeting",
    "a short biography",
    "a travel guide paragraph",
    "a press release",
    "a product description",
    "a letter of complaint",
    "a short opinion column",
    "a school report on a field trip",
    "an FAQ entry",
    "a job advertisement",
    "a museum label",
    "a weather and traffic bulletin",
    "a sports match report",
    "a short speech",
)
_SUBJECTS = (
    "a new public library",
    "a local football final",
    "a flood in a river valley",
    "an electric bus line",
    "a bakery that opened downtown",
    "a solar farm",
    "a school robotics club",
    "a marathon",
    "a rare bird sighting",
    "a city budget vote",
    "a jazz festival",
    "a hospital's new wing",
    "a smartphone launch",
    "a wildfire season",
    "a community garden",
    "a chess tournament",
    "a train strike",
    "an art exhibition",
    "a heat wave",
    "a science fair",
    "a vaccine campaign",
    "a bicycle-sharing scheme",
    "a music streaming service",
    "an earthquake drill",
    "a farmers' market",
    "a volunteer beach clean-up",
    "a new video game",
    "a company's quarterly results",
    "a pottery class",
    "a mountain rescue",
    "a school lunch programme",
    "a recycling plant",
    "a theatre premiere",
    "a space telescope",
    "a startup that makes drones",
    "a water shortage",
    "a charity concert",
    "an old castle restored",
    "a coffee shop chain",
    "a national park",
    "a hackathon",
    "a dog show",
    "a wind storm",
    "a new subway station",
    "a cooking competition",
    "a language school",
    "a power outage",
    "an Olympic swimmer",
    "a fashion week",
    "a sleep study",
    "a fishing village",
    "a hotel renovation",
    "a cyber attack on a bank",
    "an electric car",
    "a children's book award",
)
_PASSAGE_TASKS = (
    "Summarise the following text in two or three sentences:\n\n{text}",
    "What are the main points of this text? Answer with a bulleted list.\n\n{text}",
    "Read the text below and answer: who is involved, what happened, and why does it matter? Use only the "
    "text.\n\nText:\n{text}",
    "Write a headline and a one-paragraph summary for this article:\n\n{text}",
    "Rewrite the following text so that a ten-year-old can understand it:\n\n{text}",
    "Write a reply to this message:\n\n{text}",
    "List every name, place and number mentioned in this text, each with a short note on what it refers to.\n\n{text}",
    "Turn this text into four quiz questions, each followed by its answer:\n\n{text}",
    "Continue this text with two more paragraphs in the same style:\n\n{text}",
    "Give constructive feedback on the writing of this text and suggest improvements:\n\n{text}",
)
_ASKERS = (
    "a student",
    "a nurse",
    "a small-business owner",
    "a retired teacher",
    "a new parent",
    "a software developer",
    "a farmer",
    "a tourist",
    "a truck driver",
    "a journalist",
    "a chef",
    "a teenager",
    "a museum guide",
    "a lawyer",
    "an electrician",
    "a gardener",
    "a pharmacist",
    "a photographer",
)
_ASK_ABOUTS = (
    "money",
    "health",
    "cooking",
    "science homework",
    "a problem at work",
    "history",
    "a computer problem",
    "travel plans",
    "a relationship",
    "the weather",
    "a hobby",
    "a legal question",
    "a maths problem",
    "writing a story",
    "physics",
    "a pet",
    "home repairs",
    "learning English",
)


@dataclass(frozen=True)
class WrittenBrief:
    """One target-written training prompt: the target writes `brief`'s answer (the material); the training prompt is
    `task` with the material in `{text}` (or the material itself when `task` is None: a user question)."""

    brief: str
    task: str | None


def written_briefs(num_prompts: int, seed: int = 0) -> list[WrittenBrief]:
    """`num_prompts` distinct briefs for target-written material, deterministic for a seed: two thirds passages
    (a genre about a subject, then a task on the passage), one third user questions (an asker and a theme)."""
    rng = random.Random(f"moa-written-{seed}")
    out: list[WrittenBrief] = []
    seen: set[tuple[str, str | None]] = set()
    limit = len(_GENRES) * len(_SUBJECTS) * len(_PASSAGE_TASKS) + len(_ASKERS) * len(_ASK_ABOUTS) * 3
    if num_prompts > limit:
        raise ValueError(f"At most {limit} distinct written briefs; asked for {num_prompts}.")
    while len(out) < num_prompts:
        if rng.random() < 2 / 3:
            genre, subject = rng.choice(_GENRES), rng.choice(_SUBJECTS)
            brief = f"Write {genre} about {subject}. Use about 120 words and invent concrete names and numbers."
            item = WrittenBrief(brief, rng.choice(_PASSAGE_TASKS))
        else:
            form = rng.choice(
                (
                    "Write a question that {a} might ask an AI assistant about {t}. Only write the "
                    "question, in the first person.",
                    "Write a message in which {a} asks an AI assistant for advice about {t}. Give some "
                    "details of their situation. Only write the message.",
                    "Write a request from {a} who wants an AI assistant to explain something about {t}. "
                    "Only write the request.",
                )
            )
            item = WrittenBrief(form.format(a=rng.choice(_ASKERS), t=rng.choice(_ASK_ABOUTS)), None)
        key = (item.brief, item.task)
        if key in seen:  # `limit` counts every possible key, so a new one always remains
            continue
        seen.add(key)
        out.append(item)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Python API explanations: the material of the `pydoc` fine-tune of the default target (`--prompts pydoc`)
# ---------------------------------------------------------------------------------------------------------------------
# A fixed list of standard-library modules, imported to read their public API with `inspect` (signatures and
# docstrings of C functions too). The API names are split by a hash of the name into three disjoint parts: the
# fine-tune's material, the drafter's training prompts and held-out evaluation prompts.
PYDOC_MODULES = (
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "codecs", "collections",
    "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "email.message", "enum", "filecmp", "fnmatch", "fractions", "functools", "getopt",
    "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client",
    "http.cookies", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale",
    "logging", "lzma", "mimetypes", "numbers", "operator", "os", "os.path", "pathlib", "pickle", "platform",
    "plistlib", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "stat", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback", "types",
    "typing", "unicodedata", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
)  # fmt: skip
PYDOC_SPLITS = ("train", "finetune", "heldout")
PYDOC_SPLIT_BUCKETS = {"heldout": range(0, 3), "train": range(3, 9), "finetune": range(9, 20)}  # of 20 hash buckets
_PYDOC_MIN_DOC = 24
_PYDOC_MAX_DOC = 480  # characters of docstring kept (leading paragraphs): answers of about 60-150 tokens
_PYDOC_MAX_SIGNATURE = 110
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)( -> .+)?$")
_PYDOC_TEMPLATES = (
    "Explain `{name}` in Python.",
    "What does `{name}` do?",
    "How do I use the Python {kind} `{name}`?",
    "Describe `{name}` from the `{module}` module.",
    "I found `{name}` in some code. What is it for?",
)


@dataclass(frozen=True)
class PydocEntry:
    """One documented public API of the standard library: `name` is the dotted name users write (`json.dumps`)."""

    name: str
    module: str
    kind: str  # "function", "class" or "method"
    signature: str  # "(obj, *, skipkeys=False, ...)" or "" when inspect cannot tell
    doc: str  # leading paragraphs of the docstring, at most about _PYDOC_MAX_DOC characters


def _own_doc(obj) -> str | None:
    """The object's own docstring, cleaned (not one inherited from a base class, unlike `inspect.getdoc`)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else None


def _signature(obj) -> str:
    """The call signature without `self`, shortened to about _PYDOC_MAX_SIGNATURE characters ("" when unknown)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = list(signature.parameters.values())
    if params and params[0].name == "self":
        signature = signature.replace(parameters=params[1:])
    text = str(signature)
    return text if len(text) <= _PYDOC_MAX_SIGNATURE else text[: _PYDOC_MAX_SIGNATURE - 5].rsplit(",", 1)[0] + ", ...)"


def _trim_doc(doc: str) -> str:
    """Leading paragraphs of `doc` (about _PYDOC_MAX_DOC characters), a paragraph cut short ending at a sentence."""
    text = _first_paragraphs(doc, _PYDOC_MAX_DOC)
    if len(text) >= _PYDOC_MAX_DOC and ". " in text:  # one long paragraph cut mid-sentence
        text = text[: text.rindex(". ") + 1]
    return text


def _pydoc_entry(name: str, module: str, kind: str, obj) -> PydocEntry | None:
    doc = _own_doc(obj)
    signature = _signature(obj)
    first, _, rest = (doc or "").partition("\n\n")
    if _SIGNATURE_LINE.match(first):  # C functions' docs may start with their signature ("tzset()", "f(x) -> y")
        doc, signature = rest.strip(), signature or first[first.index("(") :]
    doc = _trim_doc(doc) if doc else ""
    if len(doc) < _PYDOC_MIN_DOC or " at 0x" in doc:
        return None
    return PydocEntry(name, module, kind, signature, doc)


def _is_public_member(module, attr: str, obj) -> bool:
    if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return False
    if getattr(obj, "__name__", attr) != attr or getattr(obj, "__module__", None) == "builtins":
        return False  # an alias (typing.Text is str) or a re-exported builtin
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return attr in exported
    home = getattr(obj, "__module__", None) or ""
    return home.lstrip("_") in (module.__name__.lstrip("_"), module.__name__.split(".")[0])


def _module_entries(module_name: str) -> list[PydocEntry]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a platform or a build without it
        return []
    entries = []
    for attr, obj in sorted(vars(module).items()):
        if not _is_public_member(module, attr, obj):
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        entry = _pydoc_entry(f"{module_name}.{attr}", module_name, kind, obj)
        entries.extend([entry] if entry else [])
        if kind == "class":
            for method, member in sorted(vars(obj).items()):
                if not method.startswith("_") and inspect.isroutine(member):
                    entry = _pydoc_entry(f"{module_name}.{attr}.{method}", module_name, "method", member)
                    entries.extend([entry] if entry else [])
    return entries


def pydoc_entries(split: str | None = None) -> list[PydocEntry]:
    """The documented public functions, classes and methods of `PYDOC_MODULES` (sorted by name, deduplicated), all
    of them or those of one part of `PYDOC_SPLITS` (a deterministic hash of the name decides the part)."""
    if split is not None and split not in PYDOC_SPLITS:
        raise ValueError(f"Unknown pydoc split {split!r}; use one of {PYDOC_SPLITS}.")
    found: dict[str, PydocEntry] = {}
    for module_name in PYDOC_MODULES:
        for entry in _module_entries(module_name):
            found.setdefault(entry.name, entry)
    entries = [found[name] for name in sorted(found)]
    return entries if split is None else [entry for entry in entries if pydoc_split(entry.name) == split]


def pydoc_split(name: str) -> str:
    """The part ("train", "finetune" or "heldout") an API name belongs to: a hash of the name, the same everywhere."""
    bucket = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") % 20
    return next(split for split, buckets in PYDOC_SPLIT_BUCKETS.items() if bucket in buckets)


def pydoc_question(entry: PydocEntry, variant: int = 0) -> str:
    """A user's question about `entry`: template number `variant` (modulo their count) after a per-name offset."""
    offset = int.from_bytes(hashlib.sha256(entry.name.encode("utf-8")).digest()[8:12], "big")
    template = _PYDOC_TEMPLATES[(offset + variant) % len(_PYDOC_TEMPLATES)]
    return template.format(name=entry.name, kind=entry.kind, module=entry.module)


def pydoc_prompts(num_prompts: int | None = None, split: str = "train", seed: int = 0) -> list[str]:
    """Up to `num_prompts` questions about the APIs of one split (default: every API once), deterministic for a seed.

    Every API is asked about once, in an order shuffled by `seed`, before any is asked about again with another
    template; fewer prompts than asked come back when every template of every API is used.
    """
    entries = pydoc_entries(split)
    random.Random(f"moa-pydoc-{split}-{seed}").shuffle(entries)
    n = len(entries) if num_prompts is None else int(num_prompts)
    rounds = min(len(_PYDOC_TEMPLATES), -(-n // max(1, len(entries))))
    prompts = [pydoc_question(entry, variant) for variant in range(rounds) for entry in entries]
    return prompts[:n]
