"""Prompt sources shared by training data (`moa data`) and tuning (`moa tune`): files, `datasets` folders and the
offline generator (`moa_hf.offline_prompts`), formatted with the target's chat template. Spec-Bench, the evaluation
set, is refused wherever prompts are read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .chat import chat_ids
from .offline_text import STDLIB_TEXT

__all__ = [
    "PYDOC",
    "SPEC_BENCH_KEYS",
    "WRITTEN",
    "SpecBenchPromptsError",
    "check_not_spec_bench",
    "format_prompts",
    "load_prompts",
]

SPEC_BENCH_KEYS = frozenset({"question_id", "category", "turns"})
_SPEC_BENCH_NAMES = ("spec_bench", "spec-bench", "specbench")
WRITTEN = "default:written"  # the prompt source whose material the target writes first (`written_prompts`)
PYDOC = "pydoc"  # questions about Python stdlib APIs (`pydoc`, `pydoc:heldout`): the `default:pydoc` target's material


class SpecBenchPromptsError(ValueError):
    """Raised for Spec-Bench prompts: Spec-Bench is the evaluation set and must never be trained on."""


def _refuse(what: str) -> None:
    raise SpecBenchPromptsError(
        f"{what} looks like Spec-Bench. Spec-Bench is used for evaluation only; training a drafter on it would "
        "inflate the reported acceptance lengths. Use other prompts (e.g. `--prompts default`, the offline prompt "
        "source shipped with moa_hf)."
    )


def check_not_spec_bench(source: str | os.PathLike | None = None, keys=None) -> None:
    """Raise `SpecBenchPromptsError` if a prompt source's path/name or its record keys are Spec-Bench's."""
    if source is not None and any(name in str(source).lower() for name in _SPEC_BENCH_NAMES):
        _refuse(f"The prompt source {str(source)!r}")
    if keys is not None and SPEC_BENCH_KEYS <= set(keys):
        _refuse(f"The prompt records (keys {sorted(keys)}) of {str(source)!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Prompt sources
# ---------------------------------------------------------------------------------------------------------------------
def _prompt_of(record: dict, column: str | None, where: str) -> str:
    if column is not None:
        if column not in record:
            raise KeyError(f"{where}: no field {column!r} (fields: {sorted(record)}).")
        value = record[column]
    elif "prompt" in record:
        value = record["prompt"]
    elif "turns" in record and record["turns"]:
        value = record["turns"][0]
    else:
        raise KeyError(
            f"{where}: expected a `prompt` field or a `turns` list (fields: {sorted(record)}); "
            "pass `column=` / `--prompt-column` to pick another field."
        )
    if isinstance(value, list):  # a list of turns
        value = value[0] if value else ""
    if not isinstance(value, str):
        raise TypeError(f"{where}: the prompt must be a string, got {type(value).__name__}.")
    return value


def _jsonl_prompts(path: Path, column: str | None) -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err}); expected one object per line.") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}.")
            check_not_spec_bench(path, record.keys())
            prompts.append(_prompt_of(record, column, f"{path}:{lineno}"))
    return prompts


def _dataset_prompts(ds, column: str | None, where: str) -> list[str]:
    check_not_spec_bench(where, ds.column_names)
    if column is None:
        for candidate in ("prompt", "instruction", "question", "turns", "text"):
            if candidate in ds.column_names:
                column = candidate
                break
        else:
            raise KeyError(
                f"{where}: cannot tell which column holds the prompts (columns: {ds.column_names}); "
                "pass `column=` / `--prompt-column`."
            )
    if column not in ds.column_names:
        raise KeyError(f"{where}: no column {column!r} (columns: {ds.column_names}).")
    return [_prompt_of({column: value}, column, where) for value in ds[column]]


def load_prompts(
    source: str | os.PathLike,
    *,
    column: str | None = None,
    split: str = "train",
    num_prompts: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Prompts (plain strings) from `source`, at most `num_prompts` (the first ones).

    `source` is one of:
      - ``default`` (or ``default:train`` / ``default:validation``): the offline prompt generator
        (`moa_hf.offline_prompts`); `seed` picks the sample (``default:written`` needs the target: see
        `written_prompts`);
      - ``pydoc`` (= ``pydoc:train``), ``pydoc:heldout`` or ``pydoc:finetune``: questions about Python standard-library
        APIs, the material of the ``default:pydoc`` target, from three disjoint parts of the API names (drafter
        training, held-out evaluation, and the fine-tune's own material: `moa_hf.offline_prompts.pydoc_prompts`);
      - a ``.jsonl``/``.json`` file: one object per line, the prompt in `column`, else ``prompt``, else ``turns[0]``;
      - another file: plain text, one prompt per non-empty line;
      - a folder written by `datasets`' ``save_to_disk``, or a dataset name for ``datasets.load_dataset``
        (``name`` or ``name:config``), with `split` and `column`.
    Spec-Bench (by path/name, or by its ``question_id``+``category``+``turns`` records) is refused.
    """
    text = str(source)
    check_not_spec_bench(text)
    if text == WRITTEN:
        raise ValueError(
            f"{WRITTEN!r} prompts are written by the target first: use `build_dataset` / `moa data --prompts "
            f"{WRITTEN}` (or `written_prompts(target, tokenizer, n)`), not `load_prompts`."
        )
    if text == STDLIB_TEXT:
        raise ValueError(
            f"{STDLIB_TEXT!r} holds answers for the target to label (conversations), not prompts: use it as "
            f"`moa data --prompts {STDLIB_TEXT}` (or `load_conversations`); for held-out prompts use "
            "`default:validation`."
        )
    if text == "default" or text.startswith("default:"):
        from .offline_prompts import default_prompts

        which = text.split(":", 1)[1] if ":" in text else split
        return default_prompts(num_prompts, split=which, seed=seed)
    if text == PYDOC or text.startswith(f"{PYDOC}:"):
        from .offline_prompts import pydoc_prompts

        return pydoc_prompts(num_prompts, split=text.partition(":")[2] or "train", seed=seed)
    path = Path(text).expanduser()
    if path.is_file():
        check_not_spec_bench(path.resolve())
        if path.suffix in (".jsonl", ".json"):
            prompts = _jsonl_prompts(path, column)
        else:
            with open(path, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        import datasets

        if path.is_dir():
            check_not_spec_bench(path.resolve())
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise KeyError(f"{path} has splits {list(ds)}, not {split!r}; pass `split=` / `--prompt-split`.")
                ds = ds[split]
        else:
            name, _, config = text.partition(":")
            ds = datasets.load_dataset(name, config or None, split=split)
        prompts = _dataset_prompts(ds, column, text)
    if num_prompts is not None:
        prompts = prompts[: int(num_prompts)]
    if not prompts:
        raise ValueError(f"No prompts found in {text!r}.")
    return prompts


def format_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Token ids of each prompt as a user turn of the tokenizer's chat template, ready for the assistant's answer."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The tokenizer has no chat template. Use an instruction-tuned target's tokenizer, or pass "
            "`chat_template=False` (`--no-chat-template`) to feed the raw prompt text."
        )
    out = []
    for prompt in prompts:
        if chat_template:
            ids = chat_ids(tokenizer, prompt, system_prompt)
        else:
            ids = tokenizer(prompt)["input_ids"]
        out.append(list(ids))
    return out
