"""`moa bench-vllm` (or `python -m moa_hf.vllm.bench`): vLLM alone, vLLM's `ngram` and vLLM + MoA in one run.

Each method runs in its own engine (a subprocess of this command: one vLLM engine per process), over the same
prompts at each batch size: the prompts are sent `batch` at a time, so `batch` requests run together. Reported per
method and batch: tokens/s, accepted tokens per verify step (vLLM's spec-decode counters: 1 + accepted / drafts),
acceptance by draft position, and how many outputs are identical to vLLM alone's at the same batch size (exactness
needs float32: bf16 vLLM alone already differs between batch shapes). It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["METHODS", "main", "run_bench"]

METHODS = ("vllm", "ngram", "moa")
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def cpu_flags() -> list[str]:
    """The CPU flags that decide bf16 speed here (AVX2, AVX-512 and its bf16, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in set(flags) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))


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


def worker(spec: dict) -> dict:
    """One method's engine over every batch size (run in a subprocess by `run_bench`)."""
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
    rows = []
    for batch in spec["batches"]:
        before, outputs, seconds = _spec_counters(llm), [], 0.0
        for i in range(0, len(prompts), batch):
            t = time.perf_counter()
            results = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            seconds += time.perf_counter() - t
            outputs += [list(r.outputs[0].token_ids) for r in results]
        counters = _delta(_spec_counters(llm), before)
        tokens = sum(len(o) for o in outputs)
        drafts = counters["drafts"]
        rows.append(
            {
                "batch": batch,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "tokens_per_verify_step": 1 + counters["accepted_tokens"] / drafts if drafts else None,
                "acceptance_by_position": [a / drafts for a in counters["accepted_per_pos"]] if drafts else None,
                "drafts": drafts,
                "draft_tokens": counters["draft_tokens"],
                "accepted_tokens": counters["accepted_tokens"],
                "outputs": outputs,
            }
        )
    return {"method": spec["method"], "engine_start_s": start_s, "rows": rows}


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


def run_worker(spec: dict, log: Path) -> dict:
    """`worker(spec)` in a fresh process (vLLM starts one engine per process); its log appended to `log`."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        cmd = [vllm_python(), "-m", "moa_hf.vllm.bench", "--worker", str(spec_path), str(out_path)]
        with log.open("a") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"The {spec['method']} engine failed (exit {done.returncode}); see {log}.")
        return json.loads(out_path.read_text())


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


def run_bench(args: argparse.Namespace) -> dict:
    questions = load_prompts(args.questions, args.questions_per_category, args.chat_prompts, args.seed)
    target = args.target
    if target == "default":
        from ..default_target import default_target_path

        target = str(default_target_path())
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    base = {
        "target": target,
        "dtype": args.dtype,
        "drafter": args.drafter,
        "k": args.num_speculative_tokens,
        "draft_length": args.draft_length,
        "max_tokens": args.max_new_tokens,
        "batches": args.batches,
        "prompts": [q["prompt"] for q in questions],
    }
    results = {}
    for method in args.methods:
        print(f"[bench-vllm] {method} ...", flush=True)
        results[method] = run_worker({**base, "method": method}, output / "engines.log")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="target folder or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default="default", help="MoA drafter: default, a folder or a cached Hub repo id")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS), help=",".join(METHODS))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--draft-length", type=int, default=None, help="MoA: a fixed draft length (default: measured)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/... when present)")
    p.add_argument("--questions-per-category", type=int, default=8)
    p.add_argument("--chat-prompts", type=int, default=16, help="natural chat prompts (default:validation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/bench_vllm")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-vllm", help="vLLM alone vs ngram vs MoA inside vLLM (needs the vLLM venv)")
    add_arguments(p)
    p.set_defaults(func=run_bench)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(worker(spec)))
        return
    p = argparse.ArgumentParser(prog="python -m moa_hf.vllm.bench", description=__doc__)
    add_arguments(p)
    run_bench(p.parse_args(argv))


if __name__ == "__main__":
    main()
