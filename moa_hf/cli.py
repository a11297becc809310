"""The `moa` command line. Subcommands come from a small registry of entry points (group `moa_hf.commands`), so
`moa_hf` does not import the packages that provide them (dependencies point training -> moa_hf -> modeling)."""

import argparse
import sys
from importlib.metadata import entry_points

__all__ = ["main", "build_parser"]

GROUP = "moa_hf.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa", description="Mixture-of-Attentions speculative decoding drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ModuleNotFoundError as err:  # an optional part that is not installed (e.g. training extras)
            if err.name and (err.name.split(".")[0] in ("datasets", "peft") or ep.value.startswith(err.name)):
                continue
            raise
        register(sub)  # each entry point adds its subparser(s) and sets `func`
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
