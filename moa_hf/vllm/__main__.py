"""`python -m moa_hf.vllm DRAFTER [NUM_SPECULATIVE_TOKENS]`: print the `vllm serve` flags for a MoA drafter."""

import sys

from . import serve_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        print("usage: python -m moa_hf.vllm DRAFTER [NUM_SPECULATIVE_TOKENS]  (e.g. `vllm serve TARGET $(...)`)")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    print(" ".join(serve_args(argv[0], int(argv[1]) if len(argv) > 1 else 3)))


if __name__ == "__main__":
    main()
