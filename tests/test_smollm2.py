"""The real target: SmolLM2-135M-Instruct (embedded GGUF), fp32 greedy equality and streamed text."""

import pytest
import torch
from transformers import TextStreamer

import moa_hf

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
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            inputs = tok(text, return_tensors="pt")
            ref = target.generate(**inputs, max_new_tokens=n, do_sample=False)
            streamer = _TextCollector(tok)
            out = target.generate(**inputs, max_new_tokens=n, do_sample=False, assistant_model=drafter,
                                  streamer=streamer)
            assert torch.equal(out, ref), prompt
            assert streamer.text == tok.decode(out[0, inputs["input_ids"].shape[1]:])
            assert drafter.speculation_stats.generated_tokens == out.shape[1] - inputs["input_ids"].shape[1]
