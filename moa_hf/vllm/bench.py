"""`moa bench-vllm` (or `python -m moa_hf.vllm.bench`): vLLM alone, vLLM's `ngram` and vLLM + MoA in one run.

Each method runs in its own engine (a subprocess of this command: one vLLM engine per process), over the same
prompts at each batch size: the prompts are sent `batch` at a time, so `batch` requests run together. The engines
stay up side by side and take turns group by group, so every method meets the machine's load of the same minutes.
Reported per method and batch: tokens/s, accepted tokens per verify step (vLLM's spec-decode counters: 1 +
accepted / drafts), acceptance by draft position, and how many outputs are identical to vLLM alone's at the same
batch size (exactness needs float32: bf16 vLLM alone already differs between batch shapes). It measures; it asserts
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from ..hardware import cpu_flags
from ..tune_arguments import Ints, Names

__all__ = ["METHODS", "BenchVllmArguments", "EngineProcess", "main", "run_bench", "run_engines", "run_worker"]

METHODS = ("vllm", "ngram", "moa")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def engine_kwargs(method: str, drafter: str, k: int, draft_length: int | None) -> dict:
    if method == "vllm":
        return {}
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        return {"speculative_config": spec}
    if method == "moa":
        from . import engine_args

        return engine_args(drafter, num_speculative_tokens=k, draft_length=draft_length)
    raise ValueError(f"Unknown method {method!r}; use one of {', '.join(METHODS)}.")


def _spec_counters(llm) -> dict:
    out = {name: 0.0 for name in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] += float(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(getattr(metric, "values", []))
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(values) - len(acc)), values)]
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    pos = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos)]
    return out


REPLY_PREFIX = "@@moa-bench@@ "  # marks the engine process's replies among vLLM's own output


def serve(spec: dict) -> None:
    """The engine process: start one method's engine, then run the groups of prompts that arrive on stdin (a JSON
    list of prompt indices per line), replying on stdout (`REPLY_PREFIX` + JSON) with each group's seconds, outputs and
    spec-decode counters."""
    from vllm import LLM, SamplingParams

    kwargs = engine_kwargs(spec["method"], spec["drafter"], spec["k"], spec["draft_length"])
    t0 = time.perf_counter()
    engine = {"max_num_seqs": max(spec["batches"]), **spec.get("engine", {})}  # e.g. max_num_batched_tokens
    llm = LLM(model=spec["target"], dtype=spec["dtype"], disable_log_stats=False, seed=0, **engine, **kwargs)
    start_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in spec["prompts"]
    ]  # the chat template's text: vLLM tokenizes it as transformers' `apply_chat_template` does
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=spec.get("ignore_eos", False))
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # warm-up
    print(REPLY_PREFIX + json.dumps({"engine_start_s": start_s}), flush=True)
    for line in sys.stdin:
        indices = json.loads(line)
        before = _spec_counters(llm)
        t = time.perf_counter()
        results = llm.generate([prompts[i] for i in indices], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        reply = {"seconds": seconds, "outputs": [list(r.outputs[0].token_ids) for r in results]}
        print(REPLY_PREFIX + json.dumps({**reply, **_delta(_spec_counters(llm), before)}), flush=True)


class EngineProcess:
    """One method's vLLM engine in a process of its own (vLLM starts one engine per process), idle between the
    groups of prompts it is asked to run: the bench keeps one per method alive and alternates them group by group,
    so that every method meets the machine's load of the same minutes."""

    def __init__(self, spec: dict, log: Path, module: str = "moa_hf.vllm.bench", name: str | None = None):
        """`module`'s `--serve SPEC` runs the engine (`serve` here; `moa_hf.vllm.answer.serve` writes training data);
        `name` says whose engine it is in errors (default: the method's)."""
        self.method, self.log = name or spec["method"], log
        self._tmp = tempfile.TemporaryDirectory()
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        cmd = [vllm_python(), "-m", module, "--serve", str(spec_path)]
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self.engine_start_s = self._reply()["engine_start_s"]

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX) :])
            self._log.write(line)
        self._log.flush()
        raise RuntimeError(f"The {self.method} engine exited (code {self.proc.wait()}); see {self.log}.")

    def run(self, request) -> dict:
        """Send one request line (the bench: prompt indices, generated together) and return the engine's reply (the
        bench: seconds, outputs and spec-decode counters)."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def groups(num_prompts: int, batch: int) -> list[list[int]]:
    """The prompts sent `batch` at a time."""
    return [list(range(i, min(i + batch, num_prompts))) for i in range(0, num_prompts, batch)]


def summarise(batch: int, replies: list[dict]) -> dict:
    """One method's row at one batch size from its groups' replies."""
    seconds = sum(r["seconds"] for r in replies)
    outputs = [o for r in replies for o in r["outputs"]]
    counters = {name: sum(r[name] for r in replies) for name in SPEC_COUNTERS.values()}
    by_pos = [sum(v) for v in itertools.zip_longest(*(r["accepted_per_pos"] for r in replies), fillvalue=0)]
    tokens, drafts = sum(len(o) for o in outputs), counters["drafts"]
    return {
        "batch": batch,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_verify_step": 1 + counters["accepted_tokens"] / drafts if drafts else None,
        "acceptance_by_position": [a / drafts for a in by_pos] if drafts else None,
        **counters,
        "outputs": outputs,
    }


def run_engines(base: dict, methods: list[str], log: Path) -> dict:
    """Every method's engine over every batch size, interleaved: for each group of prompts, each method in turn
    (the order rotating group by group). Returns {method: {"method", "engine_start_s", "rows"}}."""
    with contextlib.ExitStack() as stack:
        engines = {}
        for method in methods:
            print(f"[bench-vllm] starting the {method} engine ...", flush=True)
            engines[method] = stack.enter_context(EngineProcess({**base, "method": method}, log))
        replies = {(m, b): [] for m in methods for b in base["batches"]}
        turn = 0
        for batch in base["batches"]:
            for group in groups(len(base["prompts"]), batch):
                for m in methods[turn % len(methods) :] + methods[: turn % len(methods)]:
                    replies[m, batch].append(engines[m].run(group))
                turn += 1
        return {
            m: {
                "method": m,
                "engine_start_s": engines[m].engine_start_s,
                "rows": [summarise(b, replies[m, b]) for b in base["batches"]],
            }
            for m in methods
        }


def run_worker(spec: dict, log: Path) -> dict:
    """One method's engine (in a process of its own) over every batch size of `spec`: its log appended to `log`."""
    return run_engines({k: v for k, v in spec.items() if k != "method"}, [spec["method"]], log)[spec["method"]]


def vllm_python() -> str:
    """A Python with vLLM: this one, else the repository's `.venv-vllm` (`make vllm-setup`)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise RuntimeError(
        "vLLM is not installed here: `make vllm-setup` builds .venv-vllm (vLLM pins its own torch and transformers), "
        'or `pip install "moa-hf[vllm]"` in an environment of its own.'
    )


def load_prompts(questions: str | None, per_category: int, chat: int, seed: int) -> list[dict]:
    """Spec-Bench questions (`per_category` each) when the file exists, then `chat` natural chat prompts."""
    from ..bench import default_questions_path, load_questions, prompt_questions

    path = Path(questions) if questions else default_questions_path()
    selected = load_questions(path, per_category=per_category, seed=seed) if path.is_file() else []
    if chat:
        selected += prompt_questions(["default:validation"], num_prompts=chat, seed=seed)
    if not selected:
        raise ValueError(f"No prompts: {path} does not exist and --chat-prompts is 0.")
    return selected


@dataclass
class BenchVllmArguments:
    """`moa bench-vllm`'s options (also `python -m moa_hf.vllm.bench`); a list takes one comma-separated value."""

    target: str = field(
        default="default", metadata={"help": "target folder or Hub id (default: SmolLM2-135M-Instruct)"}
    )
    drafter: str = field(
        default="default", metadata={"help": "MoA drafter: default, a folder or a cached Hub repo id"}
    )
    dtype: str = field(default="bfloat16", metadata={"choices": ["bfloat16", "float32", "float16"]})
    methods: Names = field(default=Names(METHODS), metadata={"help": ",".join(METHODS)})
    batches: Ints = Ints((1, 4, 16))
    num_speculative_tokens: int = 3
    draft_length: int | None = field(default=None, metadata={"help": "MoA: a fixed draft length (default: measured)"})
    max_new_tokens: int = 96
    questions: str | None = field(
        default=None, metadata={"help": "Spec-Bench question.jsonl (default: ../shared/... when present)"}
    )
    questions_per_category: int = 8
    chat_prompts: int = field(default=16, metadata={"help": "natural chat prompts (default:validation)"})
    seed: int = 0
    output: str = "runs/bench_vllm"


def _run_command(namespace: argparse.Namespace) -> int:
    (args,) = HfArgumentParser(BenchVllmArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    run_bench(args)
    return 0


def run_bench(args: BenchVllmArguments) -> dict:
    questions = load_prompts(args.questions, args.questions_per_category, args.chat_prompts, args.seed)
    from ..loading import target_folder

    target = target_folder(args.target)  # `default` (or `default:NAME`): the cached folder
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    base = {
        "target": target,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "k": args.num_speculative_tokens,
        "draft_length": args.draft_length,
        "max_tokens": args.max_new_tokens,
        "batches": list(args.batches),
        "prompts": [q["prompt"] for q in questions],
    }
    results = run_engines(base, list(args.methods), output / "engines.log")
    reference = {row["batch"]: row["outputs"] for row in results.get("vllm", {"rows": []})["rows"]}
    table = []
    for method, result in results.items():
        alone = {r["batch"]: r["tokens_per_s"] for r in results.get("vllm", {"rows": []})["rows"]}
        for row in result["rows"]:
            ref = reference.get(row["batch"])
            same = sum(a == b for a, b in zip(row["outputs"], ref)) if ref else None
            table.append(
                {
                    "method": method,
                    **{k: v for k, v in row.items() if k != "outputs"},
                    "speedup": row["tokens_per_s"] / alone[row["batch"]] if row["batch"] in alone else None,
                    "identical": same,
                    "requests": len(row["outputs"]),
                }
            )
    record = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "cpu_flags": cpu_flags(),
        "settings": {k: v for k, v in base.items() if k != "prompts"},
        "num_prompts": len(questions),
        "categories": sorted({q["category"] for q in questions}),
        "engine_start_s": {m: r["engine_start_s"] for m, r in results.items()},
        "table": table,
    }
    (output / "bench_vllm.json").write_text(json.dumps(record, indent=1))
    (output / "bench_vllm.md").write_text(format_markdown(record))
    print(format_markdown(record))
    return record


def format_markdown(record: dict) -> str:
    s = record["settings"]
    lines = [
        f"vLLM bench {record['date']}: {record['num_prompts']} prompts ({', '.join(record['categories'])}), "
        f"{s['max_tokens']} new tokens, {s['dtype']}, k={s['k']}, CPU flags {' '.join(record['cpu_flags'])}",
        "",
        "| batch | method | tokens/s | vs vLLM alone | tokens per verify step | acceptance by position | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(record["table"], key=lambda r: (r["batch"], METHODS.index(r["method"]))):
        per_step = f"{row['tokens_per_verify_step']:.2f}" if row["tokens_per_verify_step"] else "-"
        by_pos = " / ".join(f"{a:.2f}" for a in row["acceptance_by_position"] or []) or "-"
        speed = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        same = f"{row['identical']}/{row['requests']}" if row["identical"] is not None else "-"
        lines.append(
            f"| {row['batch']} | {row['method']} | {row['tokens_per_s']:.1f} | {speed} | {per_step} | {by_pos} | "
            f"{same} |"
        )
    return "\n".join(lines) + "\n"


def register(subparsers) -> None:
    """Add `moa bench-vllm` (its options: the fields of `BenchVllmArguments`)."""
    subparsers.add_parser(
        "bench-vllm",
        parents=[HfArgumentParser(BenchVllmArguments, add_help=False)],
        help="vLLM alone vs ngram vs MoA inside vLLM (needs the vLLM venv)",
    ).set_defaults(func=_run_command)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        serve(json.loads(Path(argv[1]).read_text()))
        return
    parser = HfArgumentParser(BenchVllmArguments, prog="python -m moa_hf.vllm.bench", description=__doc__)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    run_bench(args)


if __name__ == "__main__":
    main()
