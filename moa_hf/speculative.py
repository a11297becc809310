"""The verify page of speculative decoding, chains (`greedy_accept`, `speculative_accept`, `verify`): a re-export.

The acceptance rules, chains and trees, greedy and sampling, live in one file that ships with every published drafter,
`moa_hf.modeling.custom_generate.accept` (see its docstring for the math); this module keeps the names the serving
code and older imports use.
"""

from .modeling.custom_generate.accept import (
    MIN_TEMPERATURE,
    greedy_accept,
    sampling_warpers,
    speculative_accept,
    target_probs,
    verify,
)

__all__ = ["MIN_TEMPERATURE", "greedy_accept", "sampling_warpers", "speculative_accept", "target_probs", "verify"]
