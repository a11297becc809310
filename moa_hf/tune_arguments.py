"""`moa tune`'s options: the fields of `TuneArguments`, parsed by `transformers.HfArgumentParser` as `moa train`,
`moa serve` and `moa client` are (each option spelled with hyphens or underscores). A grid option takes one
comma-separated value (`--thresholds 0,0.2,0.4`): its type is a `CommaList`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .drafter_types import drafter_kinds

__all__ = ["EXIT_GRID", "CommaList", "Floats", "Ints", "Names", "TuneArguments"]

EXIT_GRID = (0.4, 0.6, 0.8, 0.9)  # per-exit thresholds tried, besides 0 (always leave there) and NEVER


class CommaList(tuple):
    """The values of a comma-separated option ("2,3,4"), each of type `item`; a tuple when given one."""

    item: type = str

    def __new__(cls, values=()):
        if isinstance(values, str):
            try:
                values = [cls.item(text.strip()) for text in values.split(",") if text.strip()]
            except ValueError as err:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated {cls.item.__name__} values (e.g. 1,2), got {values!r}"
                ) from err
            if not values:
                raise argparse.ArgumentTypeError("expected at least one value (e.g. 1,2)")
        return super().__new__(cls, values)


class Ints(CommaList):
    item = int


class Floats(CommaList):
    item = float


class Names(CommaList):
    item = str


@dataclass
class TuneArguments:
    """What `moa tune` measures (the drafter, its targets and prompts), the grids it tries and what it writes."""

    target: list[str] = field(
        metadata={
            "action": "extend",
            "help": "`default` (SmolLM2-135M-Instruct, offline), `default:NAME` (a shipped fine-tune of it), a folder "
            "or a Hub id; give it several times to tune one setting for a drafter's several targets (pooled), each "
            "as SPEC=SOURCE[+SOURCE...] for its own prompts (e.g. default:pydoc=pydoc:heldout) or SPEC for --prompts",
        }
    )
    drafter: str = field(metadata={"help": "drafter folder (the --output of `moa train`)"})
    dtype: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "bfloat16", "float16", "float32"],
            "help": "target dtype (auto: bf16 GPU, fp32 CPU)",
        },
    )
    device: str | None = field(
        default=None, metadata={"help": "device of the target (default: cuda if available, else cpu)"}
    )
    seed: int = 0
    quiet: bool = field(default=False, metadata={"help": "no progress bars"})
    kind: str = field(
        default="auto",
        metadata={"choices": ["auto", *drafter_kinds()], "help": "drafter type (auto: from the folder's config.json)"},
    )
    prompts: list[str] = field(
        default_factory=lambda: ["default:validation", "default:documents"],
        metadata={
            "help": "held-out prompt sources, --num-prompts from each: `default:validation` (chat, maths, tutorials), "
            "`default:documents` (summarise / answer from / translate a passage), a .jsonl/.txt file, a saved "
            "`datasets` folder or a dataset name (never Spec-Bench); default: both offline splits"
        },
    )
    prompt_column: str | None = field(default=None, metadata={"help": "field/column holding the prompt"})
    num_prompts: int = field(default=8, metadata={"help": "prompts taken from each --prompts source"})
    max_new_tokens: int = 96
    num_assistant_tokens: Ints = field(
        default=Ints((2, 3, 4, 5, 6, 8)), metadata={"help": "draft lengths to try, comma-separated (2,3,4,5,6,8)"}
    )
    thresholds: Floats = field(
        default=Floats((0.0, 0.1, 0.2, 0.3, 0.4, 0.5)),
        metadata={"help": "confidence thresholds to try, comma-separated (default: 0,0.1,0.2,0.3,0.4,0.5)"},
    )
    schedules: Names = field(
        default=Names(("constant",)),
        metadata={
            "help": "draft-length schedules to try: constant, heuristic, heuristic_transient (default: constant)"
        },
    )
    lookup_tokens: Ints = field(
        default=Ints((0,)),
        metadata={
            "help": "MoA drafter: prompt-lookup draft lengths to try (0: off; capped by the draft length), "
            "comma-separated (default: 0)"
        },
    )
    lookup_min_ngrams: Ints = field(
        default=Ints((1,)),
        metadata={
            "help": "MoA drafter: shortest n-gram match that drafts by lookup instead of the network, "
            "comma-separated (default: 1)"
        },
    )
    lookup_halve_per_ngram: Ints = field(
        default=Ints((0,)),
        metadata={
            "help": "MoA drafter: 1 = a lookup match one token shorter than the longest n-gram proposes half as many "
            "tokens; values to try, comma-separated 0/1 (default: 0)"
        },
    )
    tune: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "speculation", "exits", "both"],
            "help": "what to tune: the speculation grid (draft length, threshold, schedule, lookup), the exit "
            "thresholds of a sorted MoA drafter, or both (exits first, then the grid with the best thresholds); "
            "auto: exits for a drafter with num_blocks > 1, else speculation",
        },
    )
    exit_grid: Floats = field(
        default=Floats(EXIT_GRID),
        metadata={
            "help": "exit thresholds tried for each exit besides 0 and never, comma-separated (default: "
            f"{','.join(map(str, EXIT_GRID))})"
        },
    )
    exit_rounds: int = field(
        default=1, metadata={"help": "passes of the exit-threshold search over the exits (default: 1)"}
    )
    pooled_exits: bool = field(
        default=False,
        metadata={
            "help": "several --target: tune one set of exit thresholds on all their prompts together (default: each "
            "target the drafter serves gets its own, chosen on its prompts)"
        },
    )
    repeats: int = field(default=1, metadata={"help": "passes over the prompts (more: less timing noise)"})
    allow_other_target: bool = field(
        default=False, metadata={"help": "attach even if the drafter records another target name (same signature)"}
    )
    write: bool = field(
        default=False,
        metadata={
            "help": "save the best setting into the drafter folder's generation_config.json (lookup and exit "
            "thresholds: its config.json)"
        },
    )
