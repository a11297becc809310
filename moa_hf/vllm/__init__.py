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
from dataclasses import asdict, dataclass, fields

__all__ = [
    "CONFIG_KEY",
    "MoAVllmOptions",
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


@dataclass
class MoAVllmOptions:
    """The proposer's options: what travels in vLLM's `additional_config["moa_hf"]` (`additional_config` writes it,
    the proposer reads it back with `from_vllm`).

    drafter: "default" (the shipped drafter for SmolLM2-135M-Instruct), a saved drafter folder, or a Hub repo id
    already in the local Hub cache. draft_length: draft this many tokens every step instead of choosing from measured
    costs (None). lookup: the drafter's own prompt lookup (its config's `lookup_*`), as in the transformers path.
    allow_other_target: serve a target whose weights differ from those the drafter was trained for (refused by
    default, as `attach` does). allow_untested_vllm: run on a vLLM version moa-hf was not tested with.
    catch_up_window: a row the drafter starts on (a new request, or one whose drafter state fell further behind than
    this) is read from its last this-many verified tokens only (None: all): a long prompt's full read costs about a
    tenth of its prefill, which the few tokens a tail of drafting gains do not repay; prompt lookup still sees all.
    """

    drafter: str = "default"
    draft_length: int | None = None
    lookup: bool = True
    allow_other_target: bool = False
    allow_untested_vllm: bool = False
    catch_up_window: int | None = 256

    def __post_init__(self):
        if self.catch_up_window is not None and int(self.catch_up_window) < 1:
            raise ValueError(f"catch_up_window must be >= 1 or None (all tokens), got {self.catch_up_window}.")
        if self.catch_up_window is not None:
            self.catch_up_window = int(self.catch_up_window)
        self.drafter = str(self.drafter)

    @classmethod
    def from_dict(cls, given: dict, where: str = "additional_config") -> MoAVllmOptions:
        """The options in `given`; a ValueError naming the unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"Unknown moa_hf option(s) {unknown} in {where}; known: {sorted(known)}.")
        return cls(**given)

    @classmethod
    def from_vllm(cls, vllm_config) -> MoAVllmOptions:
        """The options in a `VllmConfig`'s `additional_config["moa_hf"]` (defaults where absent)."""
        extra = vllm_config.additional_config or {}
        return cls.from_dict(dict(extra.get(CONFIG_KEY) or {}) if isinstance(extra, dict) else {})


def speculative_config(num_speculative_tokens: int = 3) -> dict:
    """vLLM's `speculative_config` for the MoA proposer: at most `num_speculative_tokens` drafted tokens per row and
    step (the proposer drafts fewer, or none, where measured costs say so)."""
    if int(num_speculative_tokens) < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(num_speculative_tokens)}


def additional_config(drafter: str | os.PathLike = "default", **options) -> dict:
    """vLLM's `additional_config` entry that tells the proposer which drafter to load and how to draft: the fields of
    `MoAVllmOptions` (a drafter folder made absolute: vLLM's workers may run elsewhere)."""
    drafter = str(drafter)
    if drafter != "default" and os.path.isdir(os.path.expanduser(drafter)):
        drafter = os.path.abspath(os.path.expanduser(drafter))
    return {CONFIG_KEY: asdict(MoAVllmOptions.from_dict({"drafter": drafter, **options}, "additional_config()"))}


def engine_args(drafter: str | os.PathLike = "default", num_speculative_tokens: int = 3, **options) -> dict:
    """Keyword arguments for `vllm.LLM(model=target, **engine_args(...))`: `speculative_config` and
    `additional_config` (options: the fields of `MoAVllmOptions`)."""
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
