"""MoA drafters inside vLLM (the optional extra `moa-hf[vllm]`; `moa_hf.modeling` never imports vLLM).

vLLM loads `MoAProposer` through its `custom_class` speculative method; the drafter and its options travel in
`additional_config["moa_hf"]`, since `speculative_config["model"]` holds the proposer's class path:

```python
from vllm import LLM, SamplingParams
import moa_hf.vllm

llm = LLM(model=target_folder, dtype="bfloat16", **moa_hf.vllm.engine_args("default", num_speculative_tokens=3))
```

or `vllm serve TARGET $(python -m moa_hf.vllm default)` for the OpenAI-compatible server. Nothing here imports
vLLM until vLLM itself builds the proposer, and moa-hf installs no vLLM plugin: a vLLM process that does not ask
for the MoA proposer runs exactly as without moa-hf.
"""

from __future__ import annotations

import json
import os

__all__ = [
    "CONFIG_KEY",
    "PROPOSER",
    "TESTED_VLLM_VERSIONS",
    "additional_config",
    "engine_args",
    "serve_args",
    "speculative_config",
]

PROPOSER = "moa_hf.vllm.proposer.MoAProposer"  # vLLM imports it by this path
CONFIG_KEY = "moa_hf"  # our key in vLLM's `additional_config`
TESTED_VLLM_VERSIONS = ("0.32.0",)  # the proposer reads vLLM internals (cache layout, attention metadata)


def speculative_config(num_speculative_tokens: int = 3) -> dict:
    """vLLM's `speculative_config` for the MoA proposer: at most `num_speculative_tokens` drafted tokens per row and
    step (the proposer drafts fewer, or none, where measured costs say so)."""
    if int(num_speculative_tokens) < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(num_speculative_tokens)}


def additional_config(
    drafter: str | os.PathLike = "default",
    *,
    draft_length: int | None = None,
    lookup: bool = True,
    allow_other_target: bool = False,
    allow_untested_vllm: bool = False,
    catch_up_window: int | None = 256,
) -> dict:
    """vLLM's `additional_config` entry that tells the proposer which drafter to load and how to draft.

    `drafter`: "default" (the shipped drafter for SmolLM2-135M-Instruct), a saved drafter folder, or a Hub repo id
    already in the local Hub cache. `draft_length`: draft this many tokens every step instead of choosing from
    measured costs. `lookup`: the drafter's prompt lookup. `allow_other_target`: serve a target whose weights differ
    from those the drafter was trained for (refused by default, as `attach` does). `catch_up_window`: a row the
    drafter starts on is read from its last this-many verified tokens (None: all of them; prompt lookup always sees
    all)."""
    if catch_up_window is not None and int(catch_up_window) < 1:
        raise ValueError(f"catch_up_window must be >= 1 or None (all tokens), got {catch_up_window}.")
    drafter = str(drafter)
    if drafter != "default" and os.path.isdir(os.path.expanduser(drafter)):
        drafter = os.path.abspath(os.path.expanduser(drafter))  # vLLM's workers may run elsewhere
    return {
        CONFIG_KEY: {
            "drafter": drafter,
            "draft_length": draft_length,
            "lookup": lookup,
            "allow_other_target": allow_other_target,
            "allow_untested_vllm": allow_untested_vllm,
            "catch_up_window": None if catch_up_window is None else int(catch_up_window),
        }
    }


def engine_args(drafter: str | os.PathLike = "default", num_speculative_tokens: int = 3, **options) -> dict:
    """Keyword arguments for `vllm.LLM(model=target, **engine_args(...))`: `speculative_config` and
    `additional_config` (options: see `additional_config`)."""
    return {
        "speculative_config": speculative_config(num_speculative_tokens),
        "additional_config": additional_config(drafter, **options),
    }


def serve_args(drafter: str | os.PathLike = "default", num_speculative_tokens: int = 3, **options) -> list[str]:
    """The same as command-line flags for `vllm serve TARGET ...`."""
    args = engine_args(drafter, num_speculative_tokens, **options)
    compact = {"separators": (",", ":")}  # no spaces: `vllm serve TARGET $(python -m moa_hf.vllm ...)` works
    return [
        "--speculative-config",
        json.dumps(args["speculative_config"], **compact),
        "--additional-config",
        json.dumps(args["additional_config"], **compact),
    ]
