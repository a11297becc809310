"""Chat data as people have it: ShareGPT and OpenAI `messages` files, multi-turn, every assistant turn kept or
written anew by the target, the loss on assistant tokens only, cycles restarting at each assistant turn."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import moa_hf
from moa_hf.conversations import (
    conversation_of,
    default_responses,
    format_conversation,
    is_conversation_source,
    load_conversations,
)
from moa_hf.prompts import SpecBenchPromptsError, load_prompts
from moa_hf.training import IGNORE_INDEX, MoADataCollator, MoATrainer, staircase_restarts
from moa_hf.training.data import build_chat_dataset

from factory import tiny_target, tiny_tokenizer, tiny_training_args

TURNS = [("Hi there", "Hello! How can I help?"), ("Add 2 and 3", "2 + 3 = 5.")]
SHAREGPT = {"conversations": [{"from": s, "value": v} for q, a in TURNS for s, v in (("human", q), ("gpt", a))]}
MESSAGES = {"messages": [{"role": r, "content": c} for q, a in TURNS for r, c in (("user", q), ("assistant", a))]}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target(logit_scale=30.0)


@pytest.mark.parametrize("record", [SHAREGPT, MESSAGES], ids=["sharegpt", "messages"])
def test_kept_turns_are_the_only_counted_tokens(tmp_path, target, record):
    tok = tiny_tokenizer()
    data = build_chat_dataset(
        target, tok, _write(tmp_path / "chat.jsonl", [record] * 3), tmp_path / "out", responses="keep", progress=False
    )
    assert len(data) == 3 and data[0]["input_ids"] == data[2]["input_ids"]
    ids, mask = data[0]["input_ids"], data[0]["response_mask"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "".join(a + "<|im_end|>" for _, a in TURNS)
    assert data[0]["prompt_length"] == mask.index(1)
    batch = MoADataCollator(pad_token_id=0)([dict(data[0]), dict(data[1])])
    counted = batch["labels"][0] != IGNORE_INDEX
    want = torch.tensor(mask[1:] + [0], dtype=torch.bool)  # position i predicts token i+1
    assert torch.equal(counted[: len(ids)], want)
    assert torch.equal(batch["labels"][0][counted], torch.tensor(ids)[1:][want[:-1]])


def test_both_formats_give_the_same_tokens(tmp_path, target):
    tok = tiny_tokenizer()
    a = format_conversation(tok, conversation_of(SHAREGPT), [1])
    b = format_conversation(tok, conversation_of(MESSAGES), [1])
    c = format_conversation(tok, conversation_of({"prompt": "Hi there", "response": "Hello! How can I help?"}), [1])
    assert a == b
    assert c[0] == a[0][: len(c[0])] and sum(c[1]) == len("Hello! How can I help?") + 1


def test_regenerated_turns_are_the_targets_answers(tmp_path, target):
    tok = tiny_tokenizer()
    data = build_chat_dataset(
        target, tok, [conversation_of(MESSAGES)], tmp_path / "out", max_new_tokens=6, batch_size=2, progress=False
    )
    ids, mask = data[0]["input_ids"], data[0]["response_mask"]
    kept, _ = format_conversation(tok, conversation_of(MESSAGES), [1])
    assert ids != kept  # the target answers differently from the file
    spans, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    assert len(spans) == 2
    first_prompt = ids[: mask.index(1)]  # the target's greedy answer to the first user turn, up to 6 tokens
    with torch.no_grad():
        out = target.generate(torch.tensor([first_prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    answer = out[0, len(first_prompt) :].tolist()
    answer = answer[: answer.index(1) + 1] if 1 in answer else answer
    assert tok.decode(spans[0]) == tok.decode(answer) + ("" if 1 in answer else "<|im_end|>")
    again = build_chat_dataset(  # resumable: the same command reuses the finished shard
        target, tok, [conversation_of(MESSAGES)], tmp_path / "out", max_new_tokens=6, batch_size=2, progress=False
    )
    assert again[0]["input_ids"] == ids


def test_staircase_restarts_at_every_assistant_turn():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    restarts = staircase_restarts(torch.tensor([2]), torch.tensor([2]), 12, mask)
    assert restarts[0].int().tolist() == [1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1]
    g = torch.Generator().manual_seed(0)  # without a mask: the prompt/response rule, unchanged
    prompts, every = torch.randint(0, 10, (5,), generator=g), torch.randint(2, 8, (5,), generator=g)
    pos = torch.arange(20)[None]
    rel = pos - prompts[:, None]
    assert torch.equal(staircase_restarts(prompts, every, 20), (rel < 0) | (rel % every[:, None] == 0))
    as_mask = staircase_restarts(prompts, every, 20, pos >= prompts[:, None])
    assert torch.equal(as_mask, staircase_restarts(prompts, every, 20))


def test_training_on_conversations(tmp_path, target):
    tok = tiny_tokenizer()
    data = build_chat_dataset(
        target, tok, [conversation_of(SHAREGPT)] * 8, tmp_path / "data", responses="keep", progress=False
    )
    trainer = MoATrainer(
        model=moa_hf.build_drafter(target), target=target, args=tiny_training_args(tmp_path), train_dataset=data
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(loss == loss and loss > 0 for loss in losses)


def test_conversation_sources_and_refusals(tmp_path):
    sharegpt = _write(tmp_path / "a.jsonl", [SHAREGPT])
    assert is_conversation_source(sharegpt)
    assert not is_conversation_source(_write(tmp_path / "p.jsonl", [{"prompt": "hi"}]))
    as_json = tmp_path / "m.json"
    as_json.write_text(json.dumps([MESSAGES, MESSAGES]))
    assert is_conversation_source(as_json) and len(load_conversations(as_json)) == 2
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([MESSAGES]).save_to_disk(str(folder))
    assert is_conversation_source(folder) and load_conversations(folder)[0] == conversation_of(MESSAGES)
    assert not is_conversation_source("default")
    with pytest.raises(ValueError, match="no assistant turn"):
        conversation_of({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError, match="`from`"):
        conversation_of({"conversations": [{"from": "robot", "value": "x"}]})
    spec = _write(tmp_path / "q.jsonl", [{"question_id": 1, "category": "x", "turns": ["a"], "messages": []}])
    with pytest.raises(SpecBenchPromptsError):
        load_conversations(spec)


def test_cli_conversations_keep_then_train_with_states(tmp_path, target, capsys):
    from moa_hf.cli import main as moa_main

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    chat = _write(tmp_path / "chat.jsonl", [SHAREGPT, MESSAGES] * 4)
    data = tmp_path / "data"
    args = ["data", "--target", str(folder), "--prompts", str(chat), "--output", str(data), "--quiet"]
    assert moa_main([*args, "--responses", "keep"]) == 0
    assert "8 conversations" in capsys.readouterr().out
    assert sum(datasets.load_from_disk(str(data))[0]["response_mask"]) == sum(len(a) + 1 for _, a in TURNS)
    out = tmp_path / "drafter"
    train = ["train", "--target", str(folder), "--data", str(data), "--states", str(tmp_path / "states")]
    train += ["--output", str(out), "--max-steps", "2", "--batch-size", "4", "--cpu", "--quiet", "--bf16", "false"]
    assert moa_main([*train, "--eval-num-prompts", "0", "--report-to", "none"]) == 0
    assert (out / "model.safetensors").exists()


def test_stdlib_text_is_real_source_the_target_labels():
    """`default:stdlib`: the installed stdlib's own text as answers (pieces of module sources cut at statements,
    module docstrings), deterministic per seed, leaving out the pydoc target's modules (its held-out material)."""
    import importlib.util

    from moa_hf.offline_prompts import PYDOC_MODULES, stdlib_modules
    from moa_hf.offline_text import STDLIB_TEXT, stdlib_text_records

    records = stdlib_text_records()
    assert len(records) > 500 and records == stdlib_text_records()
    assert stdlib_text_records(5) == records[:5] and stdlib_text_records(5, seed=1) != records[:5]
    code = [r for r in records if r["response"].startswith("```python\n") and r["response"].endswith("\n```")]
    assert len(code) > len(records) // 2 and max(len(r["response"]) for r in code) <= 2400 + len("```python\n\n```")
    for record in code[::50]:  # every piece is its module's own text, named in the prompt
        assert f"`{record['module']}" in record["prompt"]
        with open(importlib.util.find_spec(record["module"]).origin, encoding="utf-8") as f:
            assert record["response"][len("```python\n") : -len("\n```")] in f.read()
    pydoc = {name for name, _ in stdlib_modules() if name in PYDOC_MODULES or name.split(".")[0] in PYDOC_MODULES}
    # the pydoc target's material (submodules too) is left out
    assert {"json", "json.decoder", "email.message"} <= pydoc
    assert not pydoc & {r["module"] for r in records} and {"bz2", "email.utils"} <= {r["module"] for r in records}
    assert is_conversation_source(STDLIB_TEXT) and default_responses(STDLIB_TEXT) == "keep"
    assert default_responses("chat.jsonl") == "regenerate"
    assert load_conversations(STDLIB_TEXT, num_conversations=2)[1] == conversation_of(records[1])
    with pytest.raises(ValueError, match="answers for the target to label"):
        load_prompts(STDLIB_TEXT)


def test_cli_data_labels_stdlib_text_without_generating(tmp_path, target, capsys):
    """`moa data --prompts default:stdlib` keeps the stdlib's text as the answers (no `--responses` needed)."""
    from moa_hf.cli import main as moa_main
    from moa_hf.offline_text import stdlib_text_records

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    args = ["data", "--target", str(folder), "--prompts", "default:stdlib", "--num-prompts", "3"]
    assert moa_main([*args, "--output", str(tmp_path / "data"), "--quiet"]) == 0
    assert "saved 3 conversations" in capsys.readouterr().out
    data = datasets.load_from_disk(str(tmp_path / "data"))
    answers = [r["response"] for r in stdlib_text_records(3)]
    context = target.config.max_position_embeddings  # a longer conversation is cut there
    want = [min(len(a) + 1, context - row["prompt_length"]) for a, row in zip(answers, data)]  # + <|im_end|>
    assert [sum(row["response_mask"]) for row in data] == want and len(set(want)) == 3


def test_prompt_data_and_conversations_train_together(tmp_path, target):
    """A prompt+response dataset joined with conversations gets the response mask its prompt length implies: the same
    labels and drafting cycles as without it; `moa train --data PROMPTS CHATS --states A B` trains on both."""
    from moa_hf.cli import main as moa_main
    from moa_hf.training.data import with_response_masks

    prompt_rows = datasets.Dataset.from_dict(
        {"input_ids": [[2, 5, 6, 7, 8, 9, 1], [2, 5, 6, 9, 1]], "prompt_length": [3, 4], "prompt_index": [0, 1]}
    )
    assert with_response_masks([prompt_rows]) == [prompt_rows]
    masked, _ = with_response_masks([prompt_rows, datasets.Dataset.from_list([{"response_mask": [1]}])])
    assert masked["response_mask"] == [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    plain = MoADataCollator(pad_token_id=0)([dict(r) for r in prompt_rows])
    with_mask = MoADataCollator(pad_token_id=0)([dict(r) for r in masked])
    assert torch.equal(plain["labels"], with_mask["labels"])
    every, real = torch.tensor([2, 3]), plain["attention_mask"].bool()  # padding restarts or not: never read
    assert torch.equal(
        staircase_restarts(plain["prompt_lengths"], every, 7)[real],
        staircase_restarts(with_mask["prompt_lengths"], every, 7, with_mask["response_mask"])[real],
    )

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (tmp_path / "prompts.txt").write_text("Hi\nAdd 2 and 3\nName a colour\nCount to 4\n")
    common = ["--target", str(folder), "--quiet"]
    assert moa_main(["data", *common, "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "6",
                     "--output", str(tmp_path / "answers")]) == 0  # fmt: skip
    chat = _write(tmp_path / "chat.jsonl", [SHAREGPT, MESSAGES] * 2)
    assert moa_main(["data", *common, "--prompts", str(chat), "--output", str(tmp_path / "chats")]) == 0
    out = tmp_path / "drafter"
    train = ["train", *common, "--data", str(tmp_path / "answers"), str(tmp_path / "chats"), "--states"]
    train += [str(tmp_path / "s1"), str(tmp_path / "s2"), "--output", str(out), "--max-steps", "3", "--batch-size"]
    train += ["8", "--cpu", "--bf16", "false", "--eval-num-prompts", "0", "--report-to", "none"]
    assert moa_main(train) == 0
    assert json.loads((out / "training_info.json").read_text())["steps"] == 3
    assert not list((tmp_path / "answers").glob("cache-*"))  # nothing written into the data folders


# ---------------------------------------------------------------------------------------------------------------------
# Regenerated answers go in as the target's own ids; a conversation that cannot be laid out is skipped and counted
# ---------------------------------------------------------------------------------------------------------------------
_ALTERNATING = (  # a template that refuses a conversation whose roles do not alternate, as Mistral's and Llama 2's do
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _merging_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """`tiny_tokenizer` whose whitespace runs merge into one token each: the "\n" closing the template's generation
    prompt merges with an answer that starts with whitespace."""
    tokenizer = tiny_tokenizer(whitespace_runs=True)
    tokenizer.chat_template = chat_template or tokenizer.chat_template
    return tokenizer


_QUESTIONS = [("Hi there", "Add 2 and 3"), ("Name a colour", "And another"), ("Count to 4", "Now back to 1")]


def _two_turn_sharegpt(questions=_QUESTIONS) -> list[dict]:
    return [
        {"conversations": [{"from": s, "value": v} for q in qs for s, v in (("human", q), ("gpt", "Sure."))]}
        for qs in questions
    ]


def _answer_spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of ones in a response mask."""
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    return [(s, next((j for j in range(s, len(mask)) if not mask[j]), len(mask))) for s in starts]


@pytest.mark.parametrize("seed", [3, 4], ids=["answers-start-with-whitespace", "whitespace-inside-answers"])
def test_cli_regenerated_answers_are_the_targets_own_ids(tmp_path, seed):
    """`moa data --responses regenerate` on a two-turn ShareGPT file, answered by a small random Llama whose
    tokenizer merges whitespace: every stored answer is, token for token, the target's greedy continuation of the
    stored tokens before it (its ids as generated, never decoded and re-encoded), where re-encoding the text changes
    them: target 3 starts answers with whitespace, which merges with the generation prompt's newline (decoding and
    re-encoding stopped the run: "does not render a conversation's beginning as a prefix"), target 4 writes runs of
    whitespace that re-encode as other tokens. `--responses keep` on the same file works as before."""
    from moa_hf.cli import main as moa_main

    target, tok = tiny_target(seed=seed, vocab_size=128, logit_scale=30.0), _merging_tokenizer()
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tok.save_pretrained(folder)
    chat = _write(tmp_path / "chat.jsonl", _two_turn_sharegpt())
    common = ["data", "--target", str(folder), "--prompts", str(chat), "--max-new-tokens", "16", "--quiet"]
    assert moa_main([*common, "--responses", "keep", "--output", str(tmp_path / "kept")]) == 0
    assert moa_main([*common, "--responses", "regenerate", "--output", str(tmp_path / "regenerated")]) == 0
    data = datasets.load_from_disk(str(tmp_path / "regenerated"))
    assert len(data) == 3
    changed = 0  # answers whose text re-encodes to other ids
    for row in data:
        ids, mask = row["input_ids"], row["response_mask"]
        spans = _answer_spans(mask)
        assert len(spans) == 2 and row["prompt_length"] == spans[0][0]
        for start, end in spans:
            with torch.no_grad():
                out = target.generate(
                    torch.tensor([ids[:start]]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=1
                )
            generated = out[0, start:].tolist()
            generated = generated[: generated.index(1) + 1] if 1 in generated else [*generated, 1]
            assert ids[start:end] == generated  # the target's own ids, its end-of-turn token included
            changed += tok(tok.decode(ids[:end]), add_special_tokens=False)["input_ids"] != ids[:end]
    assert changed  # decoding and re-encoding would have changed the target's tokens
    assert json.loads((tmp_path / "regenerated" / "moa_data.json").read_text())["skipped"] == {}


def test_a_conversation_that_cannot_be_laid_out_is_skipped_and_counted(tmp_path, capsys):
    """One bad record among good ones: the run completes, saves the others and reports the skipped one with its
    reason (the printed summary and moa_data.json), for regenerated and kept answers alike."""
    from moa_hf.cli import main as moa_main

    target = tiny_target(seed=1, vocab_size=128, logit_scale=30.0)
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    _merging_tokenizer(_ALTERNATING).save_pretrained(folder)
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]}
    bad["messages"].append({"role": "assistant", "content": "Hi!"})
    chat = _write(tmp_path / "chat.jsonl", [*_two_turn_sharegpt()[:2], bad, _two_turn_sharegpt()[2]])
    common = ["data", "--target", str(folder), "--prompts", str(chat), "--max-new-tokens", "8", "--quiet"]
    for responses in ("regenerate", "keep"):
        out = tmp_path / responses
        assert moa_main([*common, "--responses", responses, "--output", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "saved 3 conversations" in printed and "skipped 1" in printed and "must alternate" in printed
        data = datasets.load_from_disk(str(out))
        assert data["conversation_index"] == [0, 1, 3]
        skipped = json.loads((out / "moa_data.json").read_text())["skipped"]
        assert list(skipped) == ["2"] and "Conversation roles must alternate" in skipped["2"]


def test_kept_answers_that_cannot_be_laid_out_are_skipped(tmp_path, target):
    """`responses="keep"`: a file answer the template cannot place (it starts with a newline, which merges with the
    generation prompt's) is skipped with the reason; the others are saved; nothing left to save is an error that
    says why."""
    tok = _merging_tokenizer()
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHello"}]}
    target = tiny_target(seed=1, vocab_size=128, logit_scale=30.0)
    data = build_chat_dataset(
        target, tok, [conversation_of(MESSAGES), conversation_of(bad)], tmp_path / "out", "keep", progress=False
    )
    assert data["conversation_index"] == [0]
    skipped = json.loads((tmp_path / "out" / "moa_data.json").read_text())["skipped"]
    assert list(skipped) == ["1"] and "prefix of the whole" in skipped["1"]
    with pytest.raises(ValueError, match="prefix of the whole"):
        build_chat_dataset(target, tok, [conversation_of(bad)], tmp_path / "none", "keep", progress=False)


def test_answer_layout_matches_the_templates_own_for_text_answers():
    """Answers given as the ids of their text (with or without the end-of-turn token the target would write) lay out
    exactly as `format_conversation` lays out that text, and each turn's prompt is the template's generation prompt
    for the conversation so far."""
    from moa_hf.chat import conversation_ids
    from moa_hf.training.data import _AnswerLayout

    tok, turns = tiny_tokenizer(), conversation_of(MESSAGES)
    layout = _AnswerLayout(tok, turns, [1])
    answers = [tok(a, add_special_tokens=False)["input_ids"] + [1] for _, a in TURNS]
    assert layout.ids(answers) == format_conversation(tok, turns, [1])
    assert layout.ids([a[:-1] for a in answers]) == format_conversation(tok, turns, [1])  # cut short: closed by it
    assert layout.prompt([]) == conversation_ids(tok, turns[:1])
    assert layout.prompt(answers[:1]) == conversation_ids(tok, turns[:3])


# ---------------------------------------------------------------------------------------------------------------------
# Parts and shard budgets, as for prompt data (one shard writer for both)
# ---------------------------------------------------------------------------------------------------------------------
def _numbered(n: int, long_at: int | None = None) -> list[list[dict[str, str]]]:
    """n distinct one-turn conversations; the one at `long_at` has a user turn too long for `max_tokens=120`."""
    return [
        conversation_of({"prompt": "x " * 100 if i == long_at else f"Question {i}", "response": f"Answer {i}."})
        for i in range(n)
    ]


def test_chat_data_parts_take_every_nth_conversation(tmp_path, target):
    """`part=(k, n)` (`moa data --part K/N`) takes conversations k, k+n, ...: the rows are the full run's, with their
    index in the full list (skipped ones too), and a bad part is refused."""
    tok, chats = tiny_tokenizer(), _numbered(7, long_at=3)
    kw = dict(responses="keep", max_tokens=120, shard_size=2, progress=False)
    full = build_chat_dataset(target, tok, chats, tmp_path / "full", **kw)
    assert full["conversation_index"] == [0, 1, 2, 4, 5, 6]
    rows = {i: ids for i, ids in zip(full["conversation_index"], full["input_ids"])}
    for k, want in ((0, [0, 2, 4, 6]), (1, [1, 5])):
        part = build_chat_dataset(target, tok, chats, tmp_path / f"part{k}", part=(k, 2), **kw)
        assert part["conversation_index"] == want
        assert part["input_ids"] == [rows[i] for i in want]
    skipped = json.loads((tmp_path / "part1" / "moa_data.json").read_text())["skipped"]
    assert list(skipped) == ["3"] and "max_tokens=120" in skipped["3"]  # its index in the full list
    with pytest.raises(ValueError, match="part must be"):
        build_chat_dataset(target, tok, chats, tmp_path / "bad", part=(2, 2), **kw)


def test_chat_data_max_shards_writes_the_first_shards_then_the_rest(tmp_path, target):
    """`max_shards` (`moa data --max-shards K`) on conversations: the dataset holds the first K shards (the full
    run's rows); a later run with a larger K keeps them and lays out the rest."""
    tok, chats = tiny_tokenizer(), _numbered(5)
    kw = dict(responses="keep", shard_size=2, progress=False)
    full = build_chat_dataset(target, tok, chats, tmp_path / "full", **kw)
    out = tmp_path / "budget"
    first = build_chat_dataset(target, tok, chats, out, max_shards=2, **kw)
    assert first["conversation_index"] == [0, 1, 2, 3] and first["input_ids"] == full["input_ids"][:4]
    assert sorted(p.name for p in (out / "shards").iterdir() if p.is_dir()) == ["shard-000000", "shard-000001"]
    meta = json.loads((out / "moa_data.json").read_text())
    assert (meta["shards_answered"], meta["shards_in_list"], meta["num_examples"]) == (2, 3, 4)
    stamps = {p.parent.name: p.stat().st_mtime_ns for p in (out / "shards").glob("shard-*/state.json")}
    more = build_chat_dataset(target, tok, chats, out, **kw)  # no budget: the rest
    assert more["input_ids"] == full["input_ids"]
    assert {n: (out / "shards" / n / "state.json").stat().st_mtime_ns for n in stamps} == stamps
    with pytest.raises(ValueError, match="max_shards"):
        build_chat_dataset(target, tok, chats, out, max_shards=0, **kw)


def test_cli_data_splits_conversations_with_part_and_max_shards(tmp_path, target, capsys):
    """`moa data --part K/N --max-shards M` on a conversation file: every N-th conversation from K, the first M
    shards of them."""
    from moa_hf.cli import main as moa_main

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    records = [{"prompt": f"Question {i}", "response": f"Answer {i}."} for i in range(7)]
    chat = _write(tmp_path / "chat.jsonl", records)
    args = ["data", "--target", str(folder), "--prompts", str(chat), "--responses", "keep", "--quiet"]
    args += ["--part", "1/2", "--shard-size", "1", "--max-shards", "2", "--output", str(tmp_path / "data")]
    assert moa_main(args) == 0
    assert "saved 2 conversations" in capsys.readouterr().out
    assert datasets.load_from_disk(str(tmp_path / "data"))["conversation_index"] == [1, 3]
