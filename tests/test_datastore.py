"""The drafter's n-gram datastore of the target's own responses (`set_datastore`, `moa datastore`)."""

import json

import datasets
import pytest
import torch
from conftest import make_target

import moa_hf
from moa_hf import MoADrafterModel
from moa_hf.modeling.modeling_moa import build_datastore, datastore_continuation, ngram_keys
from moa_hf.training.cli import main as moa_main


def _propose(sequences, context, max_tokens=8, n=3, vocab=50):
    tokens, order = build_datastore(sequences, n, vocab)
    keys = ngram_keys(tokens, n, vocab)[order.long()]
    assert bool((keys[1:] >= keys[:-1]).all())  # sorted: searchable
    return datastore_continuation(torch.tensor(context), tokens, order, keys, n, vocab, max_tokens).tolist()


def test_datastore_continuation_votes_and_stops_at_separators():
    seqs = [[5, 6, 7, 8, 9, 10], [1, 6, 7, 8, 9, 11], [6, 7, 8, 2, 3], [4, 6, 7, 8, 9, 10, 12]]
    # after "6 7 8": 9 (three of four), then 10 (two of the three), then only one candidate left: stop
    assert _propose(seqs, [3, 6, 7, 8]) == [9, 10]
    assert _propose(seqs, [3, 6, 7, 8], max_tokens=1) == [9]
    assert _propose(seqs, [0, 1, 2]) == []  # no such 3-gram
    assert _propose(seqs, [7, 8]) == []  # shorter than the key
    # an n-gram never spans two responses: "10 1 6" is not in the store although the tokens are adjacent
    assert _propose([[9, 10], [1, 6, 7]], [10, 1, 6]) == []
    assert _propose([[1, 2, 3, 4]], [1, 2, 3]) == [4]  # one candidate: its first token is proposed
    assert _propose([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], [1, 2, 3]) == [4, 5]  # the end of a response ends it


def _greedy(target, prompt, n=40):
    return target.generate(prompt, max_new_tokens=n, do_sample=False)


def test_datastore_drafts_are_exact_and_saved_with_the_drafter(tmp_path):
    torch.manual_seed(0)
    target = make_target("llama")
    prompt = torch.tensor([[3, 17, 42, 8, 99, 23]])
    ref = _greedy(target, prompt)
    response = ref[0, prompt.shape[1] :]
    drafter = moa_hf.build_drafter(target).eval()
    gc = drafter.generation_config
    gc.prompt_lookup_num_tokens, gc.num_assistant_tokens = 8, 8
    with moa_hf.attached(drafter, target):
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        calls_without = drafter.speculation_stats.target_calls
        assert drafter.speculation_stats.datastore_cycles == 0 and torch.equal(out, ref)

        drafter.set_datastore([response[:20], [1, 2, 3], response[10:]])  # the target's own (earlier) answers
        assert drafter.config.datastore_size == 20 + 3 + 30 + 3  # with a -1 after each response
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        stats = drafter.speculation_stats
        assert torch.equal(out, ref), "datastore drafts changed the greedy output"
        assert stats.datastore_cycles > 0 and stats.target_calls < calls_without

        gc.prompt_lookup_datastore = False  # the switch is honoured
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert drafter.speculation_stats.datastore_cycles == 0 and torch.equal(out, ref)

    drafter.save_pretrained(tmp_path)
    loaded = MoADrafterModel.from_pretrained(tmp_path)
    assert loaded.config.datastore_size == drafter.config.datastore_size
    assert torch.equal(loaded.datastore_tokens, drafter.datastore_tokens)
    assert torch.equal(loaded.datastore_order, drafter.datastore_order)
    assert loaded.generation_config.prompt_lookup_datastore is False
    context = torch.cat([prompt[0], response[:12]])
    assert torch.equal(loaded.datastore_proposal(context, 5), drafter.datastore_proposal(context, 5))
    assert loaded.datastore_proposal(context, 5).numel() > 0

    drafter.set_datastore([])  # removed again
    assert drafter.config.datastore_size == 0 and drafter.datastore_proposal(context, 5).numel() == 0


def _moa_data(folder, target_name, rows):
    datasets.Dataset.from_dict(
        {"input_ids": [p + r for p, r in rows], "prompt_length": [len(p) for p, _ in rows]}
    ).save_to_disk(str(folder))
    (folder / "moa_data.json").write_text(json.dumps({"target": target_name}))


def test_cli_datastore_stores_responses_only_and_checks_the_target(tmp_path):
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target)
    drafter.config.target_name_or_path = "org/target"
    drafter.save_pretrained(tmp_path / "drafter")
    rows = [([1, 2, 3], [10, 11, 12, 13]), ([4, 5], [20, 21, 22])]
    _moa_data(tmp_path / "data", "org/target", rows)
    assert moa_main(["datastore", str(tmp_path / "drafter"), "--data", str(tmp_path / "data")]) == 0
    loaded = MoADrafterModel.from_pretrained(tmp_path / "drafter")
    assert loaded.datastore_tokens.tolist() == [10, 11, 12, 13, -1, 20, 21, 22, -1]  # prompts left out
    assert json.loads((tmp_path / "drafter" / "generation_config.json").read_text())["prompt_lookup_datastore"]

    _moa_data(tmp_path / "other", "org/another-model", rows)
    with pytest.raises(ValueError, match="target's own responses"):
        moa_main(["datastore", str(tmp_path / "drafter"), "--data", str(tmp_path / "other")])
    with pytest.raises(FileNotFoundError, match="moa data"):
        moa_main(["datastore", str(tmp_path / "drafter"), "--data", str(tmp_path)])
