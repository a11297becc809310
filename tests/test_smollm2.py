"""The real target: SmolLM2-135M-Instruct (embedded GGUF), fp32 greedy equality and streamed text."""

import pytest
import torch
from transformers import TextStreamer

import moa_hf

pytestmark = pytest.mark.slow  # the real SmolLM2 weights (~45 s in all): `make test-all`

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return moa_hf.load_default_target(dtype=torch.float32)
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"default target unavailable: {err}")


class _TextCollector(TextStreamer):
    def __init__(self, tok):
        super().__init__(tok, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text, stream_end=False):
        self.text += text


@pytest.mark.parametrize("which", ["default", "random"])
def test_smollm2_greedy_equality_and_streamer(smollm2, which):
    target, tok = smollm2
    drafter = moa_hf.load_default_drafter(torch.float32) if which == "default" else moa_hf.build_drafter(target)
    prompts = ["What is 12 times 7?", "Name two rivers in Europe.", "Write a haiku about rain."]
    with moa_hf.attached(drafter, target):
        for prompt, n in zip(prompts, [40, 17, 29]):
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            inputs = tok(text, return_tensors="pt")
            ref = target.generate(**inputs, max_new_tokens=n, do_sample=False)
            streamer = _TextCollector(tok)
            out = target.generate(
                **inputs, max_new_tokens=n, do_sample=False, assistant_model=drafter, streamer=streamer
            )
            assert torch.equal(out, ref), prompt
            assert streamer.text == tok.decode(out[0, inputs["input_ids"].shape[1] :])
            assert drafter.speculation_stats.generated_tokens == out.shape[1] - inputs["input_ids"].shape[1]


def test_smollm2_prompt_lookup_hybrid_is_exact(smollm2):
    """The shipped drafter with prompt lookup forced on: copy-heavy answers draft by lookup, output unchanged."""
    target, tok = smollm2
    drafter = moa_hf.load_default_drafter(torch.float32)
    drafter.config.lookup_num_tokens, drafter.config.lookup_min_ngram = 8, 2
    drafter.generation_config.num_assistant_tokens = 8
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog near the river bank."
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    inputs = tok(text, return_tensors="pt")
    with moa_hf.attached(drafter, target):
        ref = target.generate(**inputs, max_new_tokens=40, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        stats = drafter.speculation_stats
    assert torch.equal(out, ref)
    assert 0 < stats.lookup_cycles < len(stats.accepted_lengths) and stats.mean_accepted_length > 1.5


def test_demo_runs_and_reports_identical_outputs(smollm2, capsys):
    from moa_hf.demo import run_demo

    result = run_demo(dtype="float32", max_new_tokens=8)
    out = capsys.readouterr().out
    assert result["acceptance_length"] > 1.0 and result["speedup"] > 0 and result["vanilla_tokens_per_s"] > 0
    assert result["differ_float32"] == 0 and "lossless: every answer is token-identical to the target alone" in out
    assert out.count("acceptance length") == 3 + 1  # each prompt, then "overall"
    assert "speculation: up to" in out
