"""The benchmark's questions: Spec-Bench's question.jsonl (categories, sampling per category) or natural prompts
(`moa_hf.prompts`), and `BenchError`, what every part of the benchmark raises for a wrong input."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from ..prompts import load_prompts

# Spec-Bench groups the 80 MT-bench questions (ids 81-160) into one category.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


class BenchError(ValueError):
    """A benchmark setting or input that cannot work; the message says how to fix it."""


# ---------------------------------------------------------------------------------------------------------------------
# Questions
# ---------------------------------------------------------------------------------------------------------------------
def default_questions_path() -> Path:
    """`<repo root>/../shared/data/spec_bench/question.jsonl`, relative to this package's repository checkout."""
    root = Path(__file__).resolve().parents[2]  # moa_hf/bench/data.py -> the checkout
    return root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def category_of(raw: str) -> str:
    return "mt_bench" if raw in MT_BENCH_CATEGORIES else raw


def load_questions(path: str | os.PathLike, per_category: int = 2, seed: int = 0) -> list[dict]:
    """Spec-Bench questions (`question_id`, `category`, `turns`): `per_category` sampled per category with `seed`
    (0 = all), as dicts {question_id, category, prompt (= turns[0])} ordered by category then id."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"Questions file {path} does not exist. Pass a Spec-Bench question.jsonl with --questions.")
    by_category: dict[str, list[dict]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question = {
                    "question_id": row["question_id"],
                    "category": category_of(str(row["category"])),
                    "prompt": str(row["turns"][0]),
                }
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                raise BenchError(
                    f"{path}:{lineno} is not a Spec-Bench question ({type(err).__name__}: {err}); each line must be a "
                    'JSON object like {"question_id": 1, "category": "qa", "turns": ["..."]}.'
                ) from err
            by_category.setdefault(question["category"], []).append(question)
    if not by_category:
        raise BenchError(f"Questions file {path} holds no questions.")
    order = [c for c in SPEC_BENCH_CATEGORIES if c in by_category] + [
        c for c in by_category if c not in SPEC_BENCH_CATEGORIES
    ]
    rng = random.Random(seed)
    selected = []
    for cat in order:
        pool = sorted(by_category[cat], key=lambda q: str(q["question_id"]))
        if 0 < per_category < len(pool):
            pool = sorted(rng.sample(pool, per_category), key=lambda q: str(q["question_id"]))
        selected += pool
    return selected


def prompt_questions(sources: list[str], num_prompts: int | None = None, seed: int = 0) -> list[dict]:
    """Natural held-out prompts as benchmark questions, `num_prompts` from each source (`moa_hf.prompts.load_prompts`:
    `default:validation`, `pydoc:heldout`, a file, ...): dicts {question_id ("SOURCE#i"), category (the source),
    prompt}, in the order given."""

    questions = []
    for source in sources:
        try:
            prompts = load_prompts(source, num_prompts=num_prompts, seed=seed)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise BenchError(
                f"--prompts {source}: {err} Pass a prompt source of `moa_hf.prompts.load_prompts` (e.g. "
                "default:validation, pydoc:heldout or a .jsonl file)."
            ) from err
        questions += [{"question_id": f"{source}#{i}", "category": source, "prompt": p} for i, p in enumerate(prompts)]
    return questions
