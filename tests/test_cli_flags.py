"""`moa bench` and `moa tune` take their flags from dataclasses (`HfArgumentParser`, as `moa train` / `moa serve` /
`moa client`): the Makefile's commands parse into them with the values they spell, and the defaults are the ones the
docs give."""

import dataclasses
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


# ---------------------------------------------------------------------------------------------------------------------
# Every command: its options are the fields of its dataclasses
# ---------------------------------------------------------------------------------------------------------------------
def command_arguments() -> dict[str, tuple]:
    """{`moa` subcommand: the dataclasses its options are the fields of}."""
    from moa_hf.demo import CostsArguments, DemoArguments
    from moa_hf.hub import PublishArguments
    from moa_hf.serving.cli import ClientCommandArguments, ServeArguments, ServeBenchArguments
    from moa_hf.serving.client_types import ClientSettings
    from moa_hf.serving.loadtest import LoadTestArguments
    from moa_hf.serving.state import ServerLimits
    from moa_hf.training.cli import DATA_ARGUMENTS, TRAIN_ARGUMENTS
    from moa_hf.training.replay_cli import ReplayArguments
    from moa_hf.training.target_finetune import FinetuneTargetArguments
    from moa_hf.vllm.bench import BenchVllmArguments

    return {
        "bench": BENCH_ARGUMENTS,
        "bench-vllm": (BenchVllmArguments,),
        "client": (ClientCommandArguments, ClientSettings),
        "costs": (CostsArguments,),
        "data": DATA_ARGUMENTS,
        "demo": (DemoArguments,),
        "finetune-target": (FinetuneTargetArguments,),
        "publish": (PublishArguments,),
        "replay": (ReplayArguments,),
        "serve": (ServeArguments, ServerLimits),
        "serve-bench": (ServeBenchArguments,),
        "serve-load": (LoadTestArguments,),
        "train": TRAIN_ARGUMENTS,
        "tune": (TuneArguments,),
    }


def _subcommands() -> dict:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    return subparsers.choices


def test_every_command_takes_its_options_from_dataclasses():
    """Each `moa` subcommand's options are exactly the fields of its dataclasses (`HfArgumentParser`: each spelled
    with hyphens and underscores, a bool defaulting to True also as --no-NAME); an option added by hand (argparse's
    `add_argument`) fails here. `moa publish`'s positional DRAFTER is no option."""
    commands = command_arguments()
    subcommands = _subcommands()
    assert sorted(subcommands) == sorted(commands)
    for name, types in commands.items():
        options = [a for a in subcommands[name]._actions if a.option_strings and a.dest != "help"]
        fields = {f.name: f for t in types for f in dataclasses.fields(t) if f.init}
        assert {a.dest for a in options} == set(fields), name
        for action in options:
            spellings = {f"--{action.dest}", f"--{action.dest.replace('_', '-')}"}
            if action.const is False:  # the --no-NAME of a bool defaulting to True (store_false)
                spellings = {f"--no_{action.dest}", f"--no-{action.dest.replace('_', '-')}"}
            else:  # and the field's own other names
                aliases = fields[action.dest].metadata.get("aliases", [])
                spellings |= {aliases} if isinstance(aliases, str) else set(aliases)
            assert set(action.option_strings) == spellings, (name, action.option_strings)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo"], {"dtype": "auto", "max_new_tokens": 96, "drafter": None, "check": True}),
        (["demo", "--no-check", "--max_new_tokens", "8", "--drafter", "d"], {"check": False, "max_new_tokens": 8}),
        (["costs", "--dtype", "float32"], {"dtype": "float32", "drafter": None}),
        (
            ["publish", "d", "--repo-id", "o/n", "--out", "x", "--target-benchmark", "a=a.json", "--own-embeddings"],
            {"repo_id": "o/n", "out": "x", "target_benchmark": ["a=a.json"], "own_embeddings": True, "push": False},
        ),
        (["serve-bench"], {"dtype": "float32", "profiles": "lan,4g,3g,satellite", "prompts": 3, "outage_after": 8}),
        (
            ["serve-load", "--clients", "2", "--serve-args=--max-batch 8"],
            {"clients": "2", "serve_args": "--max-batch 8", "max_seconds": 1800.0, "max_new_tokens": 64},
        ),
        (["bench-vllm"], {"methods": ("vllm", "ngram", "moa"), "batches": (1, 4, 16), "num_speculative_tokens": 3}),
        (["bench-vllm", "--methods", "vllm,moa", "--batches", "1,8"], {"methods": ("vllm", "moa"), "batches": (1, 8)}),
        (["replay", "--data", "d"], {"data": "d", "drafter": "default", "check": 0, "batch_size": 4}),
    ],
)
def test_converted_commands_keep_their_flags_and_defaults(argv, expected):
    """The commands once built with argparse by hand parse their old spellings into the values they had."""
    (args,) = _parse(argv, command_arguments()[argv[0]])
    assert {key: getattr(args, key) for key in expected} == expected
    if argv[0] == "publish":
        assert build_parser().parse_args(argv).drafter == "d"  # the positional DRAFTER


def test_the_makefile_publish_demo_and_vllm_bench_commands_parse():
    from moa_hf.demo import DemoArguments
    from moa_hf.hub import PublishArguments
    from moa_hf.vllm.bench import BenchVllmArguments

    ((publish, paths),) = [(_parse(argv, (PublishArguments,))[0], argv) for argv in makefile_commands("publish")]
    assert (publish.repo_id, publish.out, publish.overwrite, publish.push) == (
        "moa-hf/moa-smollm2-135m-instruct-drafter", "runs/hub", True, False
    )  # fmt: skip
    assert build_parser().parse_args(paths).drafter == "default"
    assert re.search(r"moa_hf\.cli demo$", (ROOT / "Makefile").read_text(), re.M)  # `make demo`: the defaults
    assert _parse(["demo"], (DemoArguments,)) == (DemoArguments(),)
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    for pattern, value in MAKE_VARIABLES:
        text = re.sub(pattern, value, text)
    (argv,) = [shlex.split(m) for m in re.findall(r"moa_hf\.vllm\.bench ([^;\n]*)", text)]
    (args,) = HfArgumentParser(BenchVllmArguments).parse_args_into_dataclasses(args=argv)
    assert (args.questions, args.output, args.batches) == ("q.jsonl", "runs/bench_vllm", (1, 4, 16))
