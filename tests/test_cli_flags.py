"""`moa bench` and `moa tune` take their flags from dataclasses (`HfArgumentParser`, as `moa train` / `moa serve` /
`moa client`): the Makefile's commands parse into them with the values they spell, and the defaults are the ones the
docs give."""

import re
import shlex
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from moa_hf.bench.arguments import BENCH_ARGUMENTS
from moa_hf.cli import build_parser
from moa_hf.tune_arguments import TuneArguments

ROOT = Path(__file__).resolve().parents[1]
MAKE_VARIABLES = [  # what the Makefile's recipes spell with make syntax, and a stand-in value
    (r"\$\(if \$\(QUESTIONS\),--questions \$\(QUESTIONS\)\)", "--questions q.jsonl"),
    (r"\$\(or \$\(MOA\),default\)", "default"),
    (r"\$\(RUNS\)", "runs"),
    (r"\$\$kind", "eagle"),
]


def makefile_commands(command: str) -> list[list[str]]:
    """The argument lists of every `python -m moa_hf.cli COMMAND ...` in the Makefile (continuations joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    for pattern, value in MAKE_VARIABLES:
        text = re.sub(pattern, value, text)
    return [shlex.split(f"{command} {m}") for m in re.findall(rf"moa_hf\.cli {command} ([^;\n]*)", text)]


def _parse(argv: list[str], types) -> tuple:
    return HfArgumentParser(types).parse_dict(vars(build_parser().parse_args(argv)), allow_extra_keys=True)


def test_the_makefile_tune_commands_parse_into_tune_arguments():
    commands = makefile_commands("tune")
    assert len(commands) == 4
    parsed = [_parse(argv, TuneArguments)[0] for argv in commands]
    assert parsed[0].num_assistant_tokens == (10, 24) and parsed[0].lookup_tokens == (0, 10, 24)
    assert parsed[0].thresholds == (0.3, 0.5) and parsed[0].lookup_halve_per_ngram == (0, 1) and parsed[0].write
    assert parsed[1].drafter == "runs/eagle" and parsed[1].thresholds == (0.0, 0.2, 0.4)
    assert parsed[2].target == ["default=default:validation", "default:pydoc=pydoc:heldout"]  # repeated: both kept
    assert (parsed[2].tune, parsed[2].seed, parsed[2].exit_grid) == ("exits", 1, (0.4, 0.6, 0.8, 0.9))
    shipped = parsed[3]  # `make shipped`: one pooled setting for both targets, each on its own prompts
    assert shipped.target == ["default=default:validation+default:documents", "default:pydoc=pydoc:heldout"]
    assert (shipped.tune, shipped.lookup_tokens, shipped.lookup_halve_per_ngram) == ("speculation", (24,), (1,))


def test_tune_defaults_and_comma_lists():
    (args,) = _parse(["tune", "--target", "default", "--drafter", "d"], TuneArguments)
    assert args.num_assistant_tokens == (2, 3, 4, 5, 6, 8) and args.thresholds == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    assert args.schedules == ("constant",) and args.prompts == ["default:validation", "default:documents"]
    assert (args.dtype, args.kind, args.tune, args.num_prompts, args.max_new_tokens) == ("auto", "auto", "auto", 8, 96)
    with pytest.raises(SystemExit):  # argparse: "expected comma-separated float values"
        build_parser().parse_args(["tune", "--target", "t", "--drafter", "d", "--thresholds", "0.3,x"])


def test_the_makefile_bench_command_parses_into_bench_arguments():
    (argv,) = makefile_commands("bench")
    args, paths = _parse(argv, BENCH_ARGUMENTS)
    assert (args.questions, args.questions_per_category, args.check, args.max_new_tokens) == ("q.jsonl", 8, True, 128)
    assert vars(paths) == {"moa": "default", "eagle": "runs/eagle", "independent": "runs/independent"}
    args, paths = _parse(["bench", "--prompts", "a", "b", "--no-progress", "--batch-sizes", "1,4"], BENCH_ARGUMENTS)
    assert (args.prompts, args.no_progress, args.batch_sizes, args.dtype) == (["a", "b"], True, "1,4", "bfloat16")
    assert vars(paths) == {"moa": "default", "eagle": None, "independent": None}  # the registry's bench_default


def test_the_makefile_shipped_recipe_parses_into_train_arguments():
    """`make shipped`: the default drafter's four training commands (SHIP and the step counts spelled out) parse:
    one block with both options of the shipped drafter on SmolLM2 alone, then grown to serve the pydoc target too,
    then trained twice on more answers with SmolLM2 online (no --states for it)."""
    from moa_hf.training.cli import train_arguments

    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    ship = re.search(r"^SHIP := (.*)$", text, re.M).group(1).replace("$(RUNS)", "runs")
    steps = {
        "$(SHIP_STEPS)": "2912",
        "$(SHIP_MORE_STEPS)": "1900",
        "$(SHIP_LAST_STEPS)": "1500",
        "$(SHIP_FINAL_STEPS)": "1500",
    }
    commands = [a for a in makefile_commands("train") if "$(SHIP)" in a]
    parsed = []
    for argv in commands:
        argv = [x for a in argv for x in (shlex.split(ship) if a == "$(SHIP)" else [steps.get(a, a)])]
        parsed.append(train_arguments(build_parser().parse_args(argv)))
    (_, data, drafter, command), (_, more_data, more_drafter, more), (_, last_data, last_drafter, last) = parsed[:3]
    assert drafter.context_final_hidden and drafter.ca_latest_context and drafter.init_drafter is None
    assert data.data == ["main=runs/ship/data_main"] and (command.max_steps, command.learning_rate) == (2912, 1e-3)
    assert more_drafter.init_drafter == command.output_dir and more.target_lora_rank == 8
    assert more_data.data == ["main=runs/ship/data_main", "pydoc=runs/ship/data_pydoc"]
    assert (more.max_steps, more.learning_rate) == (1900, 5e-4) and command.eval_context_ablation
    assert last_drafter.init_drafter == more.output_dir and last.output_dir == "runs/ship/moa_13m"
    assert last_data.data == ["main=runs/ship/data_main,runs/ship/data_more", "pydoc=runs/ship/data_pydoc"]
    assert last_data.states == ["pydoc=runs/ship/states_pydoc"]  # SmolLM2 online
    assert (last.max_steps, last.learning_rate, last.target_lora_rank) == (1500, 4e-4, 8)
    (_, final_data, final_drafter, final) = parsed[3]  # the same on the data with four more shards answered
    assert final_drafter.init_drafter == last.output_dir and final.output_dir == "runs/ship/moa"
    assert (final_data.data, final_data.states) == (last_data.data, last_data.states)
    assert (final.max_steps, final.learning_rate, final.target_lora_rank) == (1500, 4e-4, 8)
    assert len(parsed) == 4
