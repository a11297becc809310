"""`moa bench`'s options: the fields of `BenchArguments` and, one `--KIND` folder per kind of drafter that has
`moa bench` methods, of `DrafterPaths` (made from the drafter-type registry), parsed by `transformers.HfArgumentParser`
as `moa train`, `moa serve` and `moa client` are (each option spelled with hyphens or underscores)."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from ..drafter_types import drafter_types
from .methods import all_methods

__all__ = ["BENCH_ARGUMENTS", "BenchArguments", "DrafterPaths", "drafter_paths"]


@dataclass
class BenchArguments:
    """What `moa bench` measures, on what, and where it writes; the drafters' folders are `DrafterPaths`."""

    questions: str | None = field(
        default=None, metadata={"help": "Spec-Bench question.jsonl (default: ../shared/data/spec_bench)"}
    )
    prompts: list[str] | None = field(
        default=None,
        metadata={
            "metavar": "SOURCE",
            "help": "natural held-out prompts instead of Spec-Bench, one category per source: default:validation, "
            "default:documents, pydoc:heldout (the `default:pydoc` target's held-out API names), a .jsonl/.txt "
            "file ...",
        },
    )
    num_prompts: int = field(default=8, metadata={"help": "with --prompts: prompts taken from each source"})
    target: str = field(
        default="default",
        metadata={
            "help": "a local model folder, `default` (SmolLM2-135M-Instruct) or `default:NAME` (a shipped fine-tune)"
        },
    )
    dtype: str = field(default="bfloat16", metadata={"choices": ["bfloat16", "float16", "float32"]})
    device: str | None = field(default=None, metadata={"help": "cpu or cuda (default: cuda when available)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's)"})
    max_new_tokens: int = 128
    questions_per_category: int = field(default=2, metadata={"help": "sampled with --seed; 0 = all"})
    warmup: int = field(default=1, metadata={"help": "unrecorded generations per method before measuring"})
    repeats: int = 1
    methods: str | None = field(
        default=None,
        metadata={
            "help": f"comma list (default all: {','.join(all_methods())}; a sorted --moa drafter adds "
            "moa_exit1..K and, once tuned, moa_adaptive and moa_tree_adaptive); sorted drafters also: "
            "moa_tree_exit<k>, and the shorthands moa_exits / moa_tree_exits (every exit and the adaptive depth); "
            "variants: an engine method's fixed tree shape, METHOD@DEPTHxTOP_KxBUDGET (moa_tree_nolookup@6x8x24), "
            "and a MoA method with its context vectors zeroed, METHOD_nocontext"
        },
    )
    pld_tokens: int = field(default=10, metadata={"help": "prompt lookup decoding: tokens drafted per cycle"})
    allow_other_target: bool = field(default=False, metadata={"help": "attach drafters recorded for another target"})
    output: str | None = field(default=None, metadata={"help": "folder for bench.json, bench.md and bench.png"})
    check: bool = field(
        default=False, metadata={"help": "also check losslessness in float32 (exit 1 on a difference)"}
    )
    batch_sizes: str | None = field(
        default=None,
        metadata={
            "help": "also a batch section, e.g. 1,4,8: left-padded batches, batched target.generate vs the tree "
            "engine (with the drafter of its engine method); off by default"
        },
    )
    seed: int = 0
    no_progress: bool = field(default=False, metadata={"help": "no progress bars"})


def _path_help(record) -> str:
    default = "; `default`: the shipped one" if record.bench_default == "default" else ""
    return f"{record.label} folder of the methods {', '.join(record.bench_methods)}{default}"


# one `--KIND` option per kind with `moa bench` methods (`DrafterType.bench_methods`), by default its `bench_default`
DrafterPaths = make_dataclass(
    "DrafterPaths",
    [
        (t.kind, str | None, field(default=t.bench_default, metadata={"help": _path_help(t)}))
        for t in drafter_types()
        if t.bench_methods
    ],
)
DrafterPaths.__doc__ = "The drafters' folders of `moa bench`, one per kind of drafter (`--moa`, `--eagle`, ...)."
BENCH_ARGUMENTS = (BenchArguments, DrafterPaths)


def drafter_paths(paths) -> dict[str, str | None]:
    """{kind: folder} of a `DrafterPaths`."""
    return dict(vars(paths))
