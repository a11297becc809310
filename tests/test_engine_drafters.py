"""The speculative engine with this library's drafters (MoA, EAGLE-style): lossless through `moa_hf.generate`.

Random drafters rarely propose the target's token, so a prompt that repeats itself lets the MoA drafter's prompt
lookup branch get accepted too: accepted paths then mix lookup and network nodes, and the next catch-up feeds them.
"""

import pytest
import torch
from test_engine import FLAT_COSTS, ModelTreeDrafter, _left_pad, _peaked

import moa_hf
from moa_hf import EagleDrafterConfig, EagleDrafterModel

from factory import target_as_drafter, tiny_target, tiny_tokenizer


def _moa(target, seed=0, **overrides):
    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, lookup_num_tokens=8, **overrides).eval()
    return drafter


def _eagle(target, seed=0):
    torch.manual_seed(seed)
    return EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config, num_hidden_layers=1)).eval()


FAMILIES = ["llama", "qwen3", "gemma3-sliding", "mistral-sliding"]
CASES = [(f, k) for f in FAMILIES for k in ("moa", "moa-hidden", "moa-latest", "eagle")]
CASES += [(f, "moa-tli") for f in FAMILIES if f != "mistral-sliding"]  # TLI: a full-attention last layer


@pytest.mark.parametrize("family,kind", CASES)
def test_real_drafters_lossless_batch1_and_batch3(family, kind):
    target = _peaked(family)
    if kind == "eagle":
        drafter = _eagle(target)
    else:  # the context reads the target's final hidden states too; the CA's input adds the newest context; TLI
        options = {"context_final_hidden": kind == "moa-hidden", "ca_latest_context": kind == "moa-latest"}
        drafter = _moa(target, target_layer_inference=int(kind == "moa-tli"), **options)
    torch.manual_seed(2)
    seed = torch.randint(3, 128, (4,))
    loop = target.generate(seed[None], max_new_tokens=24, do_sample=False)[0]  # a peaked target repeats itself
    loop = torch.where(loop < 3, loop + 3, loop)  # no pad (0) inside a prompt: generate would take it for padding
    prompts = [loop[:10], loop[2:24], torch.randint(3, 128, (15,))]
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0] :] for p in prompts]
    settings = dict(tree_depth=3, tree_top_k=3, tree_budget=8, costs=FLAT_COSTS, do_sample=False, max_new_tokens=20)
    out = moa_hf.generate(target, drafter, prompts[1][None], return_dict_in_generate=True, **settings)
    assert out.sequences[0, prompts[1].shape[0] :].tolist() == refs[1].tolist()
    stats = out.speculation_stats[0]
    assert stats.drafted_tokens > 0 and stats.generated_tokens == 20
    if kind != "eagle":
        assert stats.lookup_tokens > 0
    ids, mask = _left_pad(prompts)
    out = moa_hf.generate(target, drafter, ids, attention_mask=mask, **settings)
    for b, ref in enumerate(refs):
        assert out[b, ids.shape[1] :].tolist() == ref.tolist(), f"row {b}"


def test_attachment_is_borrowed_or_temporary():
    """The engine attaches the drafter for the call and leaves no hook behind; an existing attachment stays."""
    target = _peaked()
    drafter = _moa(target)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    moa_hf.generate(target, drafter, ids, max_new_tokens=5, costs=FLAT_COSTS)
    assert not drafter.is_attached and not target._forward_hooks and not target._forward_pre_hooks
    with moa_hf.attached(drafter, target):
        moa_hf.generate(target, drafter, ids, max_new_tokens=5, costs=FLAT_COSTS)
        assert drafter.is_attached
    assert not target._forward_hooks and not target._forward_pre_hooks


def test_stop_strings_with_a_tokenizer():
    """Stop strings work as in `generate` (given `tokenizer=`), also where the string ends inside an accepted path."""
    target, tok = tiny_target(), tiny_tokenizer()
    target.generation_config.eos_token_id = None
    drafter = ModelTreeDrafter(target)
    ids = torch.tensor([tok("hello there").input_ids])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    text = tok.decode(ref[0, ids.shape[1] :])
    stop = text[8:10]  # a string greedy decoding produces mid-way
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    expected = target.generate(ids, **kwargs)
    out = moa_hf.generate(target, drafter, ids, costs=FLAT_COSTS, tree_depth=4, tree_top_k=2, tree_budget=8, **kwargs)
    assert out.tolist() == expected.tolist() and expected.shape[1] < ref.shape[1]
    with pytest.raises(ValueError, match="tokenizer"):
        moa_hf.generate(target, drafter, ids, max_new_tokens=5, stop_strings=["x"], costs=FLAT_COSTS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_layer_inference_on_trees_drafts_the_targets_tokens(family):
    """A TLI drafter that is its target (`target_as_drafter`: TLI over all layers on the token's own embedding)
    drafts the target's greedy token wherever its TLI memory (the target's keys/values of verified tokens, read at
    each tree slot's previous token) and its drafted positions' own keys/values line up with the target's cache: on
    trees of a left-padded batch (the engine) nearly every drafted greedy path is accepted, as through
    `assistant_model`; a random drafter's accepted lengths stay near 1."""
    target = _peaked(family)
    drafter = target_as_drafter(target)
    torch.manual_seed(2)
    prompts = [torch.randint(3, 128, (n,)) for n in (10, 22, 15)]
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0] :] for p in prompts]
    ids, mask = _left_pad(prompts)
    settings = dict(tree_depth=4, tree_top_k=2, tree_budget=8, costs=FLAT_COSTS, do_sample=False, max_new_tokens=20)
    out = moa_hf.generate(target, drafter, ids, attention_mask=mask, return_dict_in_generate=True, **settings)
    for b, (ref, stats) in enumerate(zip(refs, out.speculation_stats)):
        assert out.sequences[b, ids.shape[1] :].tolist() == ref.tolist(), f"row {b}"
        steady = stats.accepted_lengths[1:-1]  # the prefill's and the last (cut at 20 tokens) cycles aside
        assert min(steady) >= 3 and sum(steady) / len(steady) >= 3.5, stats.accepted_lengths  # the greedy depth: 3
    with drafter.attached(target):
        drafter.generation_config.num_assistant_tokens = 5
        target.generate(prompts[1][None], assistant_model=drafter, max_new_tokens=20, do_sample=False)
        assert drafter.speculation_stats.accepted_lengths[1:-1] == [6, 6, 6]
