"""The target's answers written by vLLM, for `moa data --engine vllm` (training data at a serving engine's speed).

vLLM pins its own torch and transformers, so it runs in a process of its own (the repository's `.venv-vllm`, or
this Python when it has vLLM; `bench.vllm_python`), started once per `moa data` run. The prompts travel as token
ids (formatted by `moa data` with the target's chat template), and the answers come back as token ids: the same
prompts, the same EOS tokens and the same greedy/sampling settings as the transformers path.

```python
with VLLMAnswerer("path/to/target", "bfloat16", max_new_tokens=256, eos=[2]) as answer:
    responses = answer([[1, 2, 3], [1, 4]], seed=0)  # one token-id list per prompt, EOS included when produced
```
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .bench import REPLY_PREFIX, EngineProcess

__all__ = ["VLLMAnswerer", "serve"]


def serve(spec: dict) -> None:
    """The engine process: start vLLM on `spec["model"]`, then answer each line of stdin (a JSON object with
    `prompts`, lists of token ids, and `seed`) with a reply line holding the answers' token ids."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=spec["max_num_seqs"])
    print(REPLY_PREFIX + json.dumps({"engine_start_s": time.perf_counter() - t0}), flush=True)
    sample = spec["do_sample"]
    for line in sys.stdin:
        request = json.loads(line)
        params = [
            SamplingParams(
                max_tokens=spec["max_new_tokens"],
                temperature=spec["temperature"] if sample else 0.0,
                top_p=spec["top_p"] if sample else 1.0,
                top_k=(spec["top_k"] or 0) if sample else 0,
                seed=request["seed"] + i if sample else None,  # one stream per prompt: reproducible per shard
                stop_token_ids=spec["eos"],
            )
            for i in range(len(request["prompts"]))
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        print(REPLY_PREFIX + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)


class VLLMAnswerer:
    """`answer(prompt_ids, seed)` -> the target's answers (token ids, EOS included when produced), written by a
    vLLM engine in a process of its own; a context manager (the engine stops on exit).

    Args:
        model: the target's folder or Hub id, as vLLM loads it.
        dtype: "bfloat16", "float16" or "float32".
        max_new_tokens, do_sample, temperature, top_p, top_k: as `moa data` takes them (greedy by default).
        eos: the token ids that end an answer.
        max_num_seqs: prompts vLLM runs together.
        log: the engine's log file (default: `vllm_answers.log` in the working directory).
    """

    def __init__(
        self,
        model: str,
        dtype: str,
        max_new_tokens: int,
        eos: list[int],
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        max_num_seqs: int = 64,
        log: str | Path = "vllm_answers.log",
    ):
        self.spec = {
            "model": str(model),
            "dtype": dtype,
            "max_new_tokens": max_new_tokens,
            "eos": list(eos),
            "do_sample": do_sample,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_num_seqs": max_num_seqs,
        }
        self.engine = EngineProcess(self.spec, Path(log), module="moa_hf.vllm.answer", name="vLLM answers")

    def __call__(self, prompt_ids: list[list[int]], seed: int = 0) -> list[list[int]]:
        outputs = self.engine.run({"prompts": [list(p) for p in prompt_ids], "seed": seed})["outputs"]
        eos = set(self.spec["eos"])
        return [out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))] for out in outputs]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> VLLMAnswerer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        raise SystemExit("usage: python -m moa_hf.vllm.answer --serve SPEC.json (started by VLLMAnswerer)")
    serve(json.loads(Path(sys.argv[2]).read_text()))
