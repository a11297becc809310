"""On-policy training data: prompts answered by the target itself, saved as a `datasets` dataset.

Each example holds `input_ids` (chat-formatted prompt followed by the target's response, no padding) and
`prompt_length`; `prompt_index` records which prompt it came from. Conversations (`build_chat_dataset`: ShareGPT,
OpenAI `messages`, prompt/response records) also hold a `response_mask` over every assistant turn, kept as given or
written anew by the target. Generation runs in left-padded batches, is written in shards and resumes after an
interruption (finished shards are kept, their prompts skipped: `shards.write_shards`, for both); `part` and
`max_shards` take every N-th prompt or conversation and the first shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from moa_hf.chat import ChatTemplateError, eos_token_ids
from moa_hf.offline_prompts import default_prompts, written_briefs
from moa_hf.prompts import WRITTEN, SpecBenchPromptsError, check_not_spec_bench, format_prompts, load_prompts

from .shards import (
    datasets_progress,
    inputs_fingerprint,
    join_shards,
    shard_folder,
    shard_seed,
    take_part,
    write_shards,
)

__all__ = [
    "SpecBenchPromptsError",
    "build_chat_dataset",
    "build_dataset",
    "check_not_spec_bench",
    "default_prompts",
    "format_prompts",
    "load_prompts",
    "skip_reasons",
    "with_response_masks",
    "written_briefs",
    "written_prompts",
]

logger = logging.getLogger(__name__)

_METADATA = "moa_data.json"


# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------
def _eos_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The target's EOS ids (`moa_hf.chat.eos_token_ids`), else the tokenizer's."""
    return eos_token_ids(target) or eos_token_ids(tokenizer)


@torch.no_grad()
def _generate(
    target: PreTrainedModel, prompt_ids: list[list[int]], gen_config: GenerationConfig, eos: list[int]
) -> list[list[int]]:
    """The target's responses (eos included when produced, no padding) to a left-padded batch of prompts."""
    pad = gen_config.pad_token_id
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)  # [B, P] left-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    device = target.device
    out = target.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen_config
    )
    responses = []
    for row in out[:, width:].tolist():  # [B, new]
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        responses.append(row[:end])  # finished rows are padded after their eos: cut there
    return responses


def _eos_and_pad(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], int]:
    eos = _eos_ids(target, tokenizer)
    return eos, (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0))


def _generation(target, tokenizer, max_new_tokens, do_sample, temperature, top_p, top_k):
    """(EOS ids, the `GenerationConfig` the target answers with): greedy unless `do_sample`."""
    eos, pad = _eos_and_pad(target, tokenizer)
    return eos, GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        top_k=top_k if do_sample else None,
        pad_token_id=pad,
        eos_token_id=eos or None,
    )


ENGINES = ("transformers", "vllm")  # what writes the target's answers (`moa data --engine`)


@contextlib.contextmanager
def _answer_engine(
    engine: str, target, gen_config: GenerationConfig, eos: list[int], batch_size: int, log: Path, model=None
):
    """None for transformers' `generate` (in this process), else a `moa_hf.vllm.answer.VLLMAnswerer` with the
    same settings (its engine stops when the block ends), loading `model` (default: the target's name_or_path)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}.")
    if engine == "transformers":
        yield None
        return
    from moa_hf.vllm.answer import VLLMAnswerer

    model = model or getattr(target.config, "name_or_path", "")
    if not model:
        raise ValueError(
            "engine='vllm' loads the target by its folder or Hub id, and this target has no name_or_path."
        )
    answerer = VLLMAnswerer(
        model,
        str(target.dtype).removeprefix("torch."),
        gen_config.max_new_tokens,
        eos,
        do_sample=bool(gen_config.do_sample),
        temperature=gen_config.temperature or 1.0,
        top_p=gen_config.top_p or 1.0,
        top_k=gen_config.top_k,
        max_num_seqs=batch_size,
        log=log,
    )
    try:
        yield answerer
    finally:
        answerer.close()


def _answer_all(
    target: PreTrainedModel,
    prompt_ids: Sequence[list[int]],
    indices: Sequence[int],
    gen_config: GenerationConfig,
    eos: list[int],
    batch_size: int,
    seed: int,
    on_batch=None,
    answerer=None,
) -> dict[int, list[int]]:
    """The target's responses to `prompt_ids[i]` for i in `indices`, in batches of similar lengths (little padding);
    sampling is seeded by `seed` without touching the global RNG. `on_batch(n)` is called after each batch.
    answerer: a vLLM engine (`_answer_engine`) that takes all of them at once (it batches them itself)."""
    order = sorted(indices, key=lambda i: -len(prompt_ids[i]))
    if answerer is not None:
        rows = dict(zip(order, answerer([prompt_ids[i] for i in order], seed)))
        if on_batch is not None:
            on_batch(len(order))
        return rows
    rows: dict[int, list[int]] = {}
    with torch.random.fork_rng(devices=[target.device] if target.device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            for i, response in zip(batch, _generate(target, [prompt_ids[i] for i in batch], gen_config, eos)):
                rows[i] = response
            if on_batch is not None:
                on_batch(len(batch))
    return rows


def _tidy_material(text: str, question: bool) -> str:
    """Target-written material made usable as a prompt: stripped, a question taken from its quotes when the target
    framed it ("A customer might ask: \"...\""), a passage cut after its last full sentence."""
    text = text.strip()
    if question:
        quoted = re.findall(r'"([^"]{20,})"', text)
        return max(quoted, key=len).strip() if quoted else text
    cut = max(text.rfind(end) for end in (". ", ".\n", "!", "?")) if not text.endswith((".", "!", "?")) else -1
    return text[: cut + 1].strip() if cut > len(text) // 2 else text


@torch.no_grad()
def written_prompts(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    *,
    seed: int = 0,
    batch_size: int = 16,
    max_material_tokens: int = 180,
    temperature: float = 0.8,
    top_p: float = 0.95,
    progress: bool = True,
) -> list[str]:
    """Training prompts built on material the target writes itself (`prompts.written_briefs`): the target samples a
    passage or a user question for each brief (seeded, deterministic on a given machine); passages are wrapped in
    their task (summarise, answer from the text, reply, ...), questions are used as they are. Briefs whose material
    comes out shorter than 40 characters are dropped, so slightly fewer than `num_prompts` may come back."""
    from tqdm.auto import tqdm

    briefs = written_briefs(num_prompts, seed=seed)
    eos, pad = _eos_and_pad(target, tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_material_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        pad_token_id=pad,
        eos_token_id=eos or None,
    )
    ids = format_prompts(tokenizer, [b.brief for b in briefs])
    with tqdm(total=len(briefs), desc="target writes material", unit="brief", disable=not progress) as bar:
        material = _answer_all(
            target, ids, range(len(briefs)), config, eos, batch_size, shard_seed(seed, -1), on_batch=bar.update
        )
    prompts = []
    for i, brief in enumerate(briefs):
        text = _tidy_material(tokenizer.decode(material[i], skip_special_tokens=True), question=brief.task is None)
        if len(text) >= 40:
            prompts.append(text if brief.task is None else brief.task.format(text=text))
    return prompts


def with_response_masks(parts: list) -> list:
    """Datasets trained on together (`moa train --data A B`): when one holds conversations (a ``response_mask``), each
    prompt+response one gets the mask its ``prompt_length`` implies (1 on the response), so that every row is read
    alike (the same labels and drafting cycles as without a mask); otherwise `parts` unchanged. Built in memory:
    nothing is written into the data folders."""
    import datasets

    if not any("response_mask" in part.column_names for part in parts):
        return parts

    def mask(example):
        n = len(example["input_ids"])
        p = min(int(example["prompt_length"]), n)
        return {"response_mask": [0] * p + [1] * (n - p)}

    out = []
    for part in parts:
        if "response_mask" not in part.column_names:
            features = part.features.copy()
            features["response_mask"] = datasets.Sequence(datasets.Value("int8"))
            with datasets_progress(False):
                part = part.map(mask, features=features, keep_in_memory=True)
        out.append(part)
    return out


def build_dataset(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: str | os.PathLike | Sequence[str],
    output_dir: str | os.PathLike,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    *,
    num_prompts: int | None = None,
    prompt_column: str | None = None,
    prompt_split: str = "train",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_tokens: int | None = None,
    shard_size: int = 512,
    part: tuple[int, int] | None = None,
    max_shards: int | None = None,
    seed: int = 0,
    progress: bool = True,
    engine: str = "transformers",
    engine_model: str | None = None,
):
    """Let `target` answer `prompts` and save (prompt + response) token ids with `datasets`' ``save_to_disk``.

    Args:
        prompts: a list of prompt strings, or a source for `load_prompts` (``default``, a JSONL/text file, a saved
            or named `datasets` dataset; Spec-Bench is refused), or ``default:written``: material the target writes
            first (`written_prompts`, needs `num_prompts`; saved in ``output_dir/written_prompts.json``, and as a
            prompt file ``written_prompts.jsonl``: to split the answers over processes with `part`, sample the
            material once and give every part that file, since sampling may differ between machines).
        output_dir: the dataset folder (``datasets.load_from_disk(output_dir)``). Finished shards are kept under
            ``output_dir/shards``; running again with the same arguments skips them (resume).
        max_new_tokens, batch_size: generation length and batch size (left-padded batches).
        do_sample, temperature, top_p, top_k: greedy by default; sampling otherwise (seeded per shard).
        max_prompt_tokens: skip longer prompts (default: what fits the target's context with the response).
        part: (k, n) answers only prompts k, k+n, k+2n, ... (to split generation over n GPUs/processes; train on
            all the parts with `moa train --data PART0 PART1 ...`). `prompt_index` keeps the index in the full list.
        max_shards: answer only the first `max_shards` shards of `shard_size` prompts (a budget on a long prompt
            list); the dataset holds those. Running again with a larger value, or without, answers the rest and keeps
            the finished shards.
        engine: what writes the answers: ``transformers`` (`target.generate`) or ``vllm`` (a vLLM engine in a
            process of its own, `moa_hf.vllm.answer`, loading the target from its `name_or_path`; the fastest
            where vLLM is installed, e.g. the repository's `.venv-vllm`); both greedy or both sampling.
        engine_model: the folder or Hub id vLLM loads (default: the target's `name_or_path`;
            `moa_hf.loading.target_folder` gives it for a `load_target` spec).
    Returns the saved `datasets.Dataset` with columns ``input_ids``, ``prompt_length``, ``prompt_index``.
    """
    import datasets

    if max_new_tokens < 1 or batch_size < 1 or shard_size < 1 or (max_shards is not None and max_shards < 1):
        raise ValueError("max_new_tokens, batch_size, shard_size and max_shards must be positive.")
    if str(prompts) == WRITTEN:
        if num_prompts is None:
            raise ValueError(f"--prompts {WRITTEN} needs a number of prompts (`num_prompts` / `--num-prompts`).")
        saved = Path(output_dir) / "written_prompts.json"  # the material is sampled once; a resumed run reuses it
        record = json.loads(saved.read_text()) if saved.is_file() else {}
        if record.get("num_prompts") == num_prompts and record.get("seed") == seed:
            prompts = record["prompts"]
        else:
            prompts = written_prompts(
                target, tokenizer, num_prompts, seed=seed, batch_size=batch_size, progress=progress
            )
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"num_prompts": num_prompts, "seed": seed, "prompts": prompts}, indent=1))
            with open(saved.with_suffix(".jsonl"), "w", encoding="utf-8") as f:  # a prompt file for `--part` runs
                f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    elif isinstance(prompts, (str, os.PathLike)):
        prompts = load_prompts(prompts, column=prompt_column, split=prompt_split, num_prompts=num_prompts, seed=seed)
    else:
        prompts = list(prompts)[: num_prompts if num_prompts is not None else None]
    if not prompts:
        raise ValueError("No prompts to answer.")
    prompts, first, stride = take_part(prompts, part)
    output_dir = Path(output_dir)

    eos, gen_config = _generation(target, tokenizer, max_new_tokens, do_sample, temperature, top_p, top_k)
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if max_prompt_tokens is None and context is not None:
        max_prompt_tokens = max(1, context - max_new_tokens)

    fingerprint = inputs_fingerprint(
        prompts=hashlib.sha256("\x00".join(prompts).encode()).hexdigest(),
        target=getattr(target.config, "name_or_path", ""),
        target_config=target.config.to_diff_dict(),
        tokenizer=getattr(tokenizer, "name_or_path", ""),
        template=getattr(tokenizer, "chat_template", None) if chat_template else None,
        system_prompt=system_prompt,
        generation=gen_config.to_diff_dict(),
        max_prompt_tokens=max_prompt_tokens,
        shard_size=shard_size,
        part=[first, stride],
        seed=seed,
    )
    skipped_long = 0

    def answer_shard(k: int, lo: int, hi: int, answerer, advance) -> dict[str, list]:
        nonlocal skipped_long
        ids = format_prompts(tokenizer, prompts[lo:hi], chat_template=chat_template, system_prompt=system_prompt)
        keep = [i for i in range(hi - lo) if max_prompt_tokens is None or len(ids[i]) <= max_prompt_tokens]
        skipped_long += hi - lo - len(keep)
        rows = _answer_all(target, ids, keep, gen_config, eos, batch_size, shard_seed(seed, k), advance, answerer)
        advance(hi - lo - len(keep))
        kept = sorted(rows)
        return {
            "input_ids": [ids[i] + rows[i] for i in kept],
            "prompt_length": [len(ids[i]) for i in kept],
            "prompt_index": [first + stride * (lo + i) for i in kept],
        }

    engine_context = _answer_engine(engine, target, gen_config, eos, batch_size, output_dir / "vllm.log", engine_model)
    num_shards, shards_in_list = write_shards(
        output_dir,
        fingerprint,
        len(prompts),
        shard_size,
        answer_shard,
        max_shards=max_shards,
        engine=engine_context,
        progress=progress,
    )
    if skipped_long:
        logger.warning("Skipped %d prompts longer than %d tokens.", skipped_long, max_prompt_tokens)

    dataset = join_shards(output_dir, num_shards, progress)
    if len(dataset) == 0:
        raise ValueError(f"Every prompt was longer than max_prompt_tokens={max_prompt_tokens}; nothing to save.")
    lengths = dataset["input_ids"]
    response_tokens = sum(len(x) for x in lengths) - sum(dataset["prompt_length"])
    metadata = {
        "target": getattr(target.config, "name_or_path", ""),
        "num_prompts": len(prompts),
        "shards_answered": num_shards,
        "shards_in_list": shards_in_list,
        "num_examples": len(dataset),
        "response_tokens": response_tokens,
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "temperature": temperature if do_sample else None,
        "top_p": top_p if do_sample else None,
        "top_k": top_k if do_sample else None,
        "chat_template": chat_template,
        "seed": seed,
        "engine": engine,
        "note": "on-policy data: responses generated by the target itself; Spec-Bench excluded by construction",
    }
    (output_dir / _METADATA).write_text(json.dumps(metadata, indent=1))
    return datasets.load_from_disk(str(output_dir))


# ---------------------------------------------------------------------------------------------------------------------
# Conversations: every assistant turn kept or written anew by the target
# ---------------------------------------------------------------------------------------------------------------------
RESPONSES = ("keep", "regenerate")


def build_chat_dataset(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: str | os.PathLike | Sequence[list[dict[str, str]]],
    output_dir: str | os.PathLike,
    responses: str = "regenerate",
    max_new_tokens: int = 256,
    batch_size: int = 16,
    *,
    num_conversations: int | None = None,
    split: str = "train",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    max_tokens: int | None = None,
    shard_size: int = 512,
    part: tuple[int, int] | None = None,
    max_shards: int | None = None,
    seed: int = 0,
    progress: bool = True,
    engine: str = "transformers",
    engine_model: str | None = None,
):
    """Training data from conversations (ShareGPT, OpenAI `messages` or prompt/response records: see
    `moa_hf.conversations`), saved like `build_dataset`'s (resumable shards) with a `response_mask` column: 1 on the
    tokens of every assistant turn, which are the only ones the drafter's loss covers.

    Args:
        responses: ``regenerate``: the target writes every assistant turn anew, turn by turn, each from the
            conversation so far with its own earlier answers (greedy, or sampled with `do_sample`, at most
            `max_new_tokens` each); its answers go into the sequence as the ids it generated (never decoded and
            re-encoded), between the template's text, so each is exactly its continuation of the tokens before it
            (`_AnswerLayout`); ``keep``: the file's answers stay (the target still labels every position through its
            states: the loss is a distillation of its next-token distribution on that text), which costs no
            generation at all.
            A conversation that cannot be laid out (the template does not render its beginning as a prefix of the
            whole, or refuses it) is skipped, and so is one whose first answer starts beyond `max_tokens`: the run
            goes on, and ``moa_data.json`` lists them under ``skipped`` (conversation index: reason).
        max_tokens: conversations longer than this many tokens are cut after the last assistant turn that fits
            (default: the target's context).
        shard_size, part, max_shards: as `build_dataset`'s, over conversations: `part` (k, n) takes conversations
            k, k+n, k+2n, ... (``conversation_index`` and ``skipped`` keep the index in the full list), `max_shards`
            the first shards of `shard_size` conversations.
        engine, engine_model: what writes regenerated turns: ``transformers`` or ``vllm`` (see `build_dataset`).
    Returns the saved dataset: ``input_ids``, ``response_mask``, ``prompt_length`` (where the first assistant turn
    starts) and ``conversation_index``.
    """
    from moa_hf.conversations import load_conversations

    if responses not in RESPONSES:
        raise ValueError(f"responses must be one of {RESPONSES}, got {responses!r}.")
    if getattr(tokenizer, "chat_template", None) is None:  # every conversation would be skipped for it
        raise ChatTemplateError("The target's tokenizer has no chat template; use an instruction-tuned target.")
    if isinstance(conversations, (str, os.PathLike)):
        conversations = load_conversations(conversations, split=split, num_conversations=num_conversations)
    else:
        conversations = list(conversations)[:num_conversations]
    conversations, first, stride = take_part(conversations, part)
    eos, gen_config = _generation(target, tokenizer, max_new_tokens, do_sample, temperature, top_p, top_k)
    regenerate = responses == "regenerate"
    if max_tokens is None:
        max_tokens = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    output_dir = Path(output_dir)
    fingerprint = inputs_fingerprint(
        conversations=hashlib.sha256(json.dumps(conversations).encode()).hexdigest(),
        target=getattr(target.config, "name_or_path", ""),
        target_config=target.config.to_diff_dict(),
        tokenizer=getattr(tokenizer, "name_or_path", ""),
        template=getattr(tokenizer, "chat_template", None),
        responses=responses,
        generation=gen_config.to_diff_dict() if regenerate else None,
        **({"answers": "generated ids"} if regenerate else {}),  # not the decoded text of earlier versions
        max_tokens=max_tokens,
        shard_size=shard_size,
        **({"part": [first, stride]} if stride > 1 else {}),  # folders written before `part` keep their manifest
        seed=seed,
    )

    def turns(lo: int, hi: int) -> int:
        return sum(t["role"] == "assistant" for c in conversations[lo:hi] for t in c)

    def lay_out_shard(k: int, lo: int, hi: int, answerer, advance) -> dict[str, list]:
        shard = conversations[lo:hi]
        if regenerate:
            seed_k = shard_seed(seed, k)
            laid_out = _regenerate_turns(
                target, tokenizer, shard, gen_config, eos, batch_size, seed_k, advance, answerer
            )
        else:
            laid_out = _kept_turns(tokenizer, shard, eos)
            advance(turns(lo, hi))
        indices = [first + stride * i for i in range(lo, hi)]  # in the full list
        return _conversation_rows(laid_out, indices, max_tokens, shard_folder(output_dir) / f"skipped-{k:06d}.json")

    engine_context = _answer_engine(engine, target, gen_config, eos, batch_size, output_dir / "vllm.log", engine_model)
    num_shards, shards_in_list = write_shards(
        output_dir,
        fingerprint,
        len(conversations),
        shard_size,
        lay_out_shard,
        max_shards=max_shards,
        engine=engine_context if regenerate else None,
        units=turns,
        desc="assistant turns",
        unit="turn",
        progress=progress,
    )
    skipped, filled = {}, []  # filled: the shards with rows (an empty saved dataset cannot be loaded back)
    for k in range(num_shards):
        listed = shard_folder(output_dir) / f"skipped-{k:06d}.json"  # absent from shards written before skipping
        skipped_k = json.loads(listed.read_text()) if listed.is_file() else {}
        skipped |= skipped_k
        if len(skipped_k) < min(len(conversations), (k + 1) * shard_size) - k * shard_size:
            filled.append(k)
    if not filled:
        raise ValueError(f"Nothing to save: no conversation could be laid out. {skip_reasons(skipped)}")
    if skipped:
        logger.warning(
            "Skipped %d of %d conversations (listed in %s): %s",
            len(skipped),
            len(conversations),
            output_dir / _METADATA,
            skip_reasons(skipped),
        )
    dataset = join_shards(output_dir, filled, progress)
    metadata = {
        "target": getattr(target.config, "name_or_path", ""),
        "num_conversations": len(conversations),
        "shards_answered": num_shards,
        "shards_in_list": shards_in_list,
        "num_examples": len(dataset),
        "num_skipped": len(skipped),
        "skipped": skipped,
        "response_tokens": int(sum(sum(m) for m in dataset["response_mask"])),
        "responses": responses,
        "max_new_tokens": max_new_tokens if regenerate else None,
        "do_sample": do_sample if regenerate else None,
        "seed": seed,
        "note": "assistant turns written by the target itself"
        if regenerate
        else "assistant turns as given; the target labels them through its next-token distribution",
    }
    (output_dir / _METADATA).write_text(json.dumps(metadata, indent=1))
    import datasets

    return datasets.load_from_disk(str(output_dir))


def skip_reasons(skipped: dict[str, str]) -> str:
    """The reasons of skipped conversations ({index: reason}), each once with how many it skipped."""
    counts: dict[str, int] = {}
    for reason in skipped.values():
        counts[reason] = counts.get(reason, 0) + 1
    return " ".join(f"{n} x {reason}" for reason, n in counts.items())


def _conversation_rows(laid_out, indices: list[int], max_tokens: int | None, skipped_file: Path) -> dict[str, list]:
    """A shard of conversations as training rows (token ids and assistant-turn mask, each cut after the last
    assistant token within `max_tokens`), from `laid_out`: one (ids, mask) or the reason it could not be laid out per
    conversation, conversation `indices[i]` of the list. The skipped ones go to `skipped_file` (index: reason),
    written before the shard itself (resumable)."""
    columns = {"input_ids": [], "response_mask": [], "prompt_length": [], "conversation_index": []}
    skipped = {}
    for index, row in zip(indices, laid_out):
        if isinstance(row, str):
            skipped[str(index)] = row
            continue
        ids, mask = row
        if max_tokens is not None and len(ids) > max_tokens:  # cut after the last assistant token that fits
            ends = [j + 1 for j in range(max_tokens) if mask[j]]
            if not ends:
                skipped[str(index)] = f"Its first answer starts beyond max_tokens={max_tokens}."
                continue
            ids, mask = ids[: ends[-1]], mask[: ends[-1]]
        columns["input_ids"].append(ids)
        columns["response_mask"].append(mask)
        columns["prompt_length"].append(mask.index(1))
        columns["conversation_index"].append(index)
    skipped_file.write_text(json.dumps(skipped, indent=1))
    return columns


# What cannot be laid out: a ValueError (the template is not prefix-stable) or the template's own refusal.
_LAYOUT_ERRORS = (ValueError, TemplateError)


def _kept_turns(tokenizer, conversations, eos) -> list:
    """(ids, mask) of every conversation with its answers as given (`format_conversation`), or why it cannot be laid
    out."""
    from moa_hf.conversations import format_conversation

    out = []
    for conversation in conversations:
        try:
            out.append(format_conversation(tokenizer, conversation, eos))
        except _LAYOUT_ERRORS as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


class _AnswerLayout:
    """A conversation in the chat template with its assistant turns' contents left open, to be filled with token
    ids as generated: the template's text around them is rendered (each answer stands in as a placeholder) and
    tokenized piece by piece, the answers spliced in verbatim, so that an answer's ids are never decoded and
    re-encoded (which can change them) and the sequence before each answer is exactly the prompt it answered.

    Raises ValueError where the template does not render the conversation's beginning (with the generation prompt)
    as a prefix of the whole, or does not render a content where it stands."""

    _PLACEHOLDER = "\u27e8moa-answer-{}\u27e9"  # no whitespace: templates that trim contents leave it whole

    def __init__(self, tokenizer, turns: list[dict[str, str]], eos: list[int]):
        self.tokenizer, self.eos = tokenizer, set(eos)
        positions = [j for j, t in enumerate(turns) if t["role"] == "assistant"]
        marks = [self._PLACEHOLDER.format(k) for k in range(len(positions))]
        turns = [dict(t) for t in turns]
        for j, mark in zip(positions, marks):
            turns[j]["content"] = mark
        render = tokenizer.apply_chat_template
        whole = render(turns[: positions[-1] + 1], tokenize=False, add_generation_prompt=False)
        self.heads, self.tails = [], []  # text before answer k (since the turn before closed) and the turn's closing
        done = 0  # characters of `whole` laid out
        for j, mark in zip(positions, marks):
            before = render(turns[:j], tokenize=False, add_generation_prompt=True)
            through = render(turns[: j + 1], tokenize=False, add_generation_prompt=False)
            if (
                whole.count(mark) != 1
                or len(before) < done
                or not whole.startswith(through)
                or not through.startswith(before + mark)
            ):
                raise ValueError(
                    "The chat template does not render a conversation's beginning as a prefix of the whole (or does "
                    "not render an assistant turn's content as it is), so the target's answers cannot be placed in "
                    "it; pass prompt/response pairs (one assistant turn each) or a template that does."
                )
            self.heads.append(self._encode(before[done:]))
            self.tails.append(self._encode(through[len(before) + len(mark) :]))
            done = len(through)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def __len__(self) -> int:
        return len(self.heads)

    def prompt(self, answers: list[list[int]]) -> list[int]:
        """The token ids the target answers turn `len(answers)` from, after its earlier `answers`."""
        return self.ids(answers)[0] + self.heads[len(answers)]

    def ids(self, answers: list[list[int]]) -> tuple[list[int], list[int]]:
        """(token ids, response mask) of the conversation through its turn `len(answers) - 1`, every answer's ids
        as given. The mask is 1 on the answers' tokens; an answer that ends with an EOS id stands for the template's
        closing up to its end-of-turn token (its first EOS id), one cut short of it is followed by that closing,
        the end-of-turn token marked too (as `format_conversation` marks it)."""
        ids: list[int] = []
        mask: list[int] = []
        for head, answer, tail in zip(self.heads, answers, self.tails):
            end = next((i + 1 for i, tok in enumerate(tail) if tok in self.eos), None)
            if answer and answer[-1] in self.eos:
                tail, marked = (tail[end:] if end is not None else tail), 0
            else:
                marked = end if end is not None else len(tail)
            ids += head + answer + tail
            mask += [0] * len(head) + [1] * (len(answer) + marked) + [0] * (len(tail) - marked)
        return ids, mask


def _regenerate_turns(target, tokenizer, conversations, gen_config, eos, batch_size, seed, advance, answerer=None):
    """The target's answers to every assistant turn of `conversations`, each to the conversation before it with its
    own earlier answers (turn k of every conversation in one batched pass), laid out with them as generated
    (`_AnswerLayout`): (ids, mask) per conversation, or why it cannot be laid out (the file's answers unused)."""
    layouts = {}
    out: list = [None] * len(conversations)
    for c, conversation in enumerate(conversations):
        try:
            layouts[c] = _AnswerLayout(tokenizer, conversation, eos)
        except _LAYOUT_ERRORS as err:
            out[c] = f"{type(err).__name__}: {err}"
            advance(sum(t["role"] == "assistant" for t in conversation))
    answers: dict[int, list[list[int]]] = {c: [] for c in layouts}
    for k in range(max((len(layout) for layout in layouts.values()), default=0)):
        order = [c for c, layout in layouts.items() if k < len(layout)]
        prompt_ids = [layouts[c].prompt(answers[c]) for c in order]
        rows = _answer_all(
            target, prompt_ids, range(len(order)), gen_config, eos, batch_size, seed + k, advance, answerer
        )
        for i, c in enumerate(order):
            answers[c].append(list(rows[i]))
    for c, layout in layouts.items():
        out[c] = layout.ids(answers[c])
    return out
