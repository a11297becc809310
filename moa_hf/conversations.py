"""Chat data as people have it: ShareGPT `conversations`, OpenAI `messages` and prompt/response records, read into
one form (a list of ``{"role", "content"}`` turns) and tokenized with the target's chat template so that every token an
assistant wrote is marked (`format_conversation`'s response mask): the drafter's loss covers those tokens only.

Spec-Bench, the evaluation set, is refused here as everywhere prompts are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .chat import conversation_ids
from .offline_text import STDLIB_TEXT, stdlib_text_records
from .prompts import check_not_spec_bench

__all__ = [
    "CONVERSATION_FIELDS",
    "conversation_of",
    "default_responses",
    "format_conversation",
    "is_conversation_record",
    "is_conversation_source",
    "load_conversations",
]

# ShareGPT speaker names -> roles
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
_SHAREGPT_ROLES |= {"bard": "assistant", "bing": "assistant", "system": "system"}
_RESPONSE_FIELDS = ("response", "completion", "answer", "output")
CONVERSATION_FIELDS = ("conversations", "messages", *_RESPONSE_FIELDS)  # a record with one of these is a conversation


def is_conversation_record(record: dict) -> bool:
    """Whether a data record holds a conversation (turns, or a prompt with its response), not a prompt alone."""
    return any(field in record for field in CONVERSATION_FIELDS)


def conversation_of(record: dict, where: str = "record") -> list[dict[str, str]]:
    """One record as ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.

    Accepted: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}`` (ShareGPT),
    ``{"messages": [{"role": ..., "content": ...}]}`` (OpenAI) and ``{"prompt": ..., "response" | "completion" |
    "answer" | "output": ...}``. Every assistant turn must follow a user (or system) turn."""
    if "conversations" in record:
        turns = []
        for i, turn in enumerate(record["conversations"]):
            speaker = str(turn.get("from", "")).lower()
            if speaker not in _SHAREGPT_ROLES or "value" not in turn:
                raise ValueError(
                    f"{where}: ShareGPT turn {i} needs `from` (one of {sorted(_SHAREGPT_ROLES)}) and `value`, got "
                    f"{sorted(turn)}."
                )
            turns.append({"role": _SHAREGPT_ROLES[speaker], "content": turn["value"]})
    elif "messages" in record:
        turns = [{"role": m.get("role"), "content": m.get("content")} for m in record["messages"]]
    else:
        response = next((record[f] for f in _RESPONSE_FIELDS if f in record), None)
        if "prompt" not in record or response is None:
            raise ValueError(
                f"{where}: expected `conversations` (ShareGPT), `messages` (OpenAI) or `prompt` with one of "
                f"{list(_RESPONSE_FIELDS)}; got fields {sorted(record)}."
            )
        turns = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": response}]
    for i, turn in enumerate(turns):
        if turn["role"] not in ("system", "user", "assistant") or not isinstance(turn["content"], str):
            raise ValueError(f"{where}: turn {i} needs a role system/user/assistant and string content, got {turn}.")
    if not any(t["role"] == "assistant" for t in turns):
        raise ValueError(f"{where}: the conversation has no assistant turn to train on.")
    if turns[0]["role"] == "assistant":
        raise ValueError(f"{where}: the conversation starts with an assistant turn; it needs a user turn first.")
    return turns


def is_conversation_source(source: str | os.PathLike) -> bool:
    """Whether a data source holds conversations rather than prompts: ``default:stdlib`` (`STDLIB_TEXT`), or a
    .jsonl/.json file or `datasets` folder whose first record has one of `CONVERSATION_FIELDS`. Other sources (the
    offline prompt generators, dataset names) hold prompts."""
    if str(source) == STDLIB_TEXT:
        return True
    path = Path(str(source)).expanduser()
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        records = _file_records(path)
        return bool(records) and isinstance(records[0], dict) and is_conversation_record(records[0])
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        import datasets

        ds = datasets.load_from_disk(str(path))
        names = next(iter(ds.values())).column_names if isinstance(ds, datasets.DatasetDict) else ds.column_names
        return any(field in names for field in CONVERSATION_FIELDS)
    return False


def default_responses(source: str | os.PathLike) -> str:
    """What `moa data` does with a conversation source's answers unless told (``--responses``): ``keep`` for
    ``default:stdlib`` (real text for the target to label), ``regenerate`` for the others."""
    return "keep" if str(source) == STDLIB_TEXT else "regenerate"


def load_conversations(
    source: str | os.PathLike, *, split: str = "train", num_conversations: int | None = None
) -> list[list[dict[str, str]]]:
    """Conversations (see `conversation_of`) from ``default:stdlib`` (`moa_hf.offline_text`), a ``.jsonl`` file (one
    record per line), a ``.json`` file (a list of records), a `datasets` folder or a dataset name (``name`` or
    ``name:config``, with `split`)."""
    text = str(source)
    check_not_spec_bench(text)
    path = Path(text).expanduser()
    if text == STDLIB_TEXT:
        records, where = stdlib_text_records(), text
    elif path.is_file():
        check_not_spec_bench(path.resolve())
        records, where = _file_records(path), str(path)
    else:
        import datasets

        if path.is_dir():
            check_not_spec_bench(path.resolve())
            ds = datasets.load_from_disk(str(path))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            name, _, config = text.partition(":")
            ds = datasets.load_dataset(name, config or None, split=split)
        records, where = list(ds), text
    if num_conversations is not None:
        records = records[: int(num_conversations)]
    out = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: record {i} is a {type(record).__name__}, not an object.")
        check_not_spec_bench(where, record.keys())
        out.append(conversation_of(record, f"{where}: record {i}"))
    if not out:
        raise ValueError(f"No conversations found in {text!r}.")
    return out


def _file_records(path: Path) -> list:
    """The records of a .json file (a list) or of a JSON Lines file (one per non-empty line)."""
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".json":
            records = json.load(f)
            return records if isinstance(records, list) else [records]
        return [json.loads(line) for line in f if line.strip()]


def format_conversation(
    tokenizer: PreTrainedTokenizerBase, turns: list[dict[str, str]], eos_ids: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, response mask) of a conversation in the tokenizer's chat template; the mask is 1 on the tokens of
    every assistant turn (its text and the end-of-turn token, up to the first of `eos_ids`), 0 on everything the
    template or the other speakers add.

    Each assistant turn is located by rendering the conversation before it with the generation prompt: the
    template must render a conversation's beginning as a prefix of the whole (true of the common templates)."""
    eos = set(eos_ids or [])
    ids: list[int] = []
    mask: list[int] = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = conversation_ids(tokenizer, turns[:i], add_generation_prompt=True)
        through = conversation_ids(tokenizer, turns[: i + 1], add_generation_prompt=False)
        if before[: len(ids)] != ids or through[: len(before)] != before:
            raise ValueError(
                "The chat template does not render a conversation's beginning as a prefix of the whole, so assistant "
                "turns cannot be located; pass prompt/response pairs (one assistant turn each) instead."
            )
        span = through[len(before) :]  # the assistant's text, its end-of-turn token and the template's closing text
        end = next((k + 1 for k, tok in enumerate(span) if tok in eos), len(span))
        mask += [0] * (len(before) - len(ids)) + [1] * end + [0] * (len(span) - end)
        ids = through
    return ids, mask
