"""`moa bench`: decoding methods with one target on Spec-Bench questions, per method and per category.

Every method runs greedily in the same process on the same questions, interleaved (for each question and repeat all
methods run, in an order rotated per question) so that machine noise hits them alike. Measured per method, per category
and overall: acceptance length (new tokens / target forward calls), tokens/s, speedup over `vanilla`, and the
theoretical speedup bound of Leviathan et al. (2023) from the measured acceptance, draft length and drafter cost.
`--check` re-runs every speculative method with the target in float32 and compares its token ids with plain greedy
decoding. Numbers are measured, never assumed.

Methods: `vanilla` (the target alone), `moa` / `moa_nolookup` (the MoA drafter through transformers' assisted
generation, with its prompt lookup as configured / off), `moa_tree` / `moa_tree_nolookup` / `moa_chain` (the same
drafter through the tree engine `speculative_generate`: its chosen tree settings with prompt lookup as configured,
lookup off, and a chain: top-k 1 without lookup), `eagle`, `independent` (a small causal LM) and `pld` (prompt lookup
decoding). `--batch-sizes 1,4,8` adds a batch section: left-padded batches of prompts of different lengths, batched
`target.generate` against the engine, counting only the real new tokens of each row (up to its EOS).

Sorted drafters (`num_blocks` K > 1, exits after blocks 1..K): `moa_exit1` .. `moa_exitK` draft at one fixed exit
(`fixed_exit_thresholds`) and `moa_adaptive` with the drafter's tuned `exit_thresholds` (`moa tune --write`), through
assisted generation; `moa_tree_exit1` .. `moa_tree_exitK` and `moa_tree_adaptive` the same through the tree engine
(prompt lookup as the drafter's config says, for all of them). `moa_exits` / `moa_tree_exits` name all of them at
once. Every method of a MoA drafter reports its tokens drafted per exit (`exit_counts`; prompt-lookup tokens are not
drafted by an exit). Two variants are written after a method's name: `@DEPTHxTOP_KxBUDGET` fixes an engine method's
tree shape (`moa_tree_nolookup@6x8x24`: depth 6, top-k 8, at most 24 drafted nodes per verification), and `_nocontext`
runs a MoA method with the drafter's context vectors zeroed (`moa_nolookup_nocontext`,
`moa_tree_nolookup@6x8x24_nocontext`) and `_tokenwise` runs a block drafter token by token (its own chain, the same
weights: `moa_nolookup_tokenwise`): run next to the same method, the report gives the share of the drafter's gain
that comes from the target's state. `--prompts SOURCE ...` replaces the Spec-Bench questions by natural held-out
prompts (`moa_hf.prompts.load_prompts`: `default:validation`, `default:documents`, `pydoc:heldout`, files, datasets),
one category per source.

The package by job: data.py (Spec-Bench questions, natural prompts), methods.py (the decoding methods and
`--methods`), counting.py (target calls and the metrics), runner.py (running, the lossless check, batches),
report.py (Markdown and chart), arguments.py (its flags: dataclasses, a `--KIND` folder per registered kind of
drafter), cli.py (`moa bench`).
"""

from ..hardware import hardware_info
from .cli import register
from .counting import (
    CallCounter,
    acceptance_length,
    count_forward_calls,
    expected_length,
    solve_alpha,
    speedup_bound,
    summarize,
)
from .data import (
    MT_BENCH_CATEGORIES,
    SPEC_BENCH_CATEGORIES,
    BenchError,
    category_of,
    default_questions_path,
    load_questions,
    prompt_questions,
)
from .methods import (
    ADAPTIVE_METHODS,
    ENGINE_METHODS,
    EXIT_SHORTHANDS,
    NO_CONTEXT,
    BenchMethod,
    MethodVariant,
    all_methods,
    build_methods,
    drafter_method,
    engine_method,
    engine_record,
    exit_method_names,
    exit_methods_of,
    independent_method,
    method_kind,
    method_variant,
    pld_method,
    resolve_method_names,
    vanilla_method,
    without_context,
)
from .report import context_share, format_exit_setting, format_markdown, format_value, plot_benchmark
from .runner import check_lossless, generate_once, real_new_tokens, run_batches, run_benchmark

__all__ = [
    "ADAPTIVE_METHODS",
    "BenchError",
    "BenchMethod",
    "CallCounter",
    "ENGINE_METHODS",
    "EXIT_SHORTHANDS",
    "MethodVariant",
    "NO_CONTEXT",
    "MT_BENCH_CATEGORIES",
    "SPEC_BENCH_CATEGORIES",
    "acceptance_length",
    "all_methods",
    "build_methods",
    "category_of",
    "check_lossless",
    "context_share",
    "count_forward_calls",
    "default_questions_path",
    "drafter_method",
    "engine_method",
    "engine_record",
    "exit_method_names",
    "exit_methods_of",
    "expected_length",
    "format_exit_setting",
    "format_markdown",
    "format_value",
    "generate_once",
    "hardware_info",
    "independent_method",
    "load_questions",
    "method_kind",
    "method_variant",
    "pld_method",
    "plot_benchmark",
    "prompt_questions",
    "real_new_tokens",
    "register",
    "resolve_method_names",
    "run_batches",
    "run_benchmark",
    "solve_alpha",
    "speedup_bound",
    "summarize",
    "vanilla_method",
    "without_context",
]
