"""Online training steps for a large target without its weights: train tokens/s and peak memory.

    python -m moa_hf.training.step_check --target-config llama-3.1-8b --batch-size 4 --seq-len 2048 --output DIR
    python -m moa_hf.training.step_check --target-config small --batch-size 4 --seq-len 512 --output DIR  # CPU

A target of a known architecture (`TARGET_CONFIGS`: Llama-3.1-8B-Instruct's config, or a small one for CPUs) is built
with random weights in bf16 directly on the device (nothing is downloaded: the step's cost does not depend on the
weights), with the MoA drafter of the recipe for it (`RECIPES`, docs/training.md). `MoATrainer` then trains on
random token sequences with the target online (its forward inside every step) and `profile_steps` timing the step
(`throughput.json`). Each setting runs in a process of its own, so its peak memory is its own: without and with
activation checkpointing of the drafter's layers. Written to `DIR/step_check.json`; it measures, it asserts nothing.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["RECIPES", "TARGET_CONFIGS", "StepCheckArguments", "main", "run_setting"]

# Llama-3.1-8B-Instruct's architecture (its config.json), SmolLM2-135M-Instruct's (the default target) and a small
# Llama that a CPU trains in seconds.
TARGET_CONFIGS = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(  # the default target's architecture (SmolLM2-135M-Instruct)
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    ),
}

# The drafter and step of the recipe for each (docs/training.md, "An 8B target on GPUs"); the small one scaled down.
RECIPES = {
    "llama-3.1-8b": dict(
        draft_vocab_size=32768, lsa_hidden_size=1024, intermediate_size=6144, min_cycle=6, max_cycle=14
    ),
    "smollm2-135m": dict(  # the shipped default drafter's shape
        draft_vocab_size=8192,
        lsa_hidden_size=128,
        context_final_hidden=True,
        ca_latest_context=True,
        min_cycle=2,
        max_cycle=8,
    ),
    "small": dict(draft_vocab_size=2048, lsa_hidden_size=128, intermediate_size=512, min_cycle=2, max_cycle=8),
}


def build_target(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """A random-weight target of `TARGET_CONFIGS[name]` on `device`, frozen, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TARGET_CONFIGS[name])
    config.name_or_path = f"random-{name}"
    with torch.device(device):
        target = LlamaForCausalLM(config).to(dtype)
    return target.eval().requires_grad_(False)


def random_data(num: int, seq_len: int, vocab: int, seed: int = 0):
    """`num` random sequences of `seq_len` tokens, the first eighth a prompt (as `moa data` saves them)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (num, seq_len), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "prompt_length": [max(1, seq_len // 8)] * num})


def run_setting(name: str, batch_size: int, seq_len: int, steps: int, checkpointing: bool, device: str) -> dict:
    """One setting, in this process: tokens/s (`throughput.json`'s) and peak memory (the device's allocator on a
    GPU, the process's peak resident memory on a CPU)."""
    from . import MoATrainer, MoATrainingArguments
    from .drafters import adapter_named
    from .throughput import WARMUP_STEPS

    device = torch.device(device)
    target = build_target(name, device)
    recipe = dict(RECIPES[name])
    cycles = {"min_cycle": recipe.pop("min_cycle"), "max_cycle": recipe.pop("max_cycle")}
    drafter = adapter_named("moa").build(target, **recipe)
    drafter.init_draft_vocab(torch.arange(recipe["draft_vocab_size"]), target.get_output_embeddings().weight)
    on_cpu = device.type == "cpu"
    with tempfile.TemporaryDirectory() as out:
        args = MoATrainingArguments(
            output_dir=out,
            max_steps=WARMUP_STEPS + steps,
            per_device_train_batch_size=batch_size,
            learning_rate=1e-4,
            bf16=True,
            use_cpu=on_cpu,
            activation_checkpointing=checkpointing,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            logging_steps=1000,
            eval_num_prompts=0,
            profile_steps=steps,
            **cycles,
        )
        data = random_data(batch_size * (WARMUP_STEPS + steps), seq_len, TARGET_CONFIGS[name]["vocab_size"])
        if not on_cpu:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        trainer = MoATrainer(model=drafter, target=target, args=args, train_dataset=data)
        trainer.train()
        profile = json.loads((Path(out) / "throughput.json").read_text())
    if on_cpu:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    else:
        peak = torch.cuda.max_memory_allocated(device)
    return {
        "target_config": name,
        "device": str(device),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "activation_checkpointing": checkpointing,
        "checkpointed_layers": sum(bool(getattr(m, "gradient_checkpointing", False)) for m in drafter.modules()),
        "drafter_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "train_tokens_per_second": profile["train_tokens_per_second"],
        "seconds_per_step": profile["seconds_per_step"],
        "ms_per_step": profile["ms_per_step"],
        "mfu": profile["mfu"],
        # a GPU: the allocator's peak; a CPU: the process's peak resident set (ru_maxrss is in KiB on Linux)
        "peak_memory_gib": round(peak / 2**30, 2),
        "peak_memory_kind": "cuda max_memory_allocated" if not on_cpu else "process max RSS",
        "wall_seconds": round(time.perf_counter() - start, 1),
        "hardware": profile["hardware"],
    }


@dataclass
class StepCheckArguments:
    """`python -m moa_hf.training.step_check`: one target architecture, batch and sequence length."""

    target_config: str = field(
        default="llama-3.1-8b", metadata={"choices": sorted(TARGET_CONFIGS), "help": "The target's architecture."}
    )
    batch_size: int = field(default=4, metadata={"help": "Sequences per step."})
    seq_len: int = field(default=2048, metadata={"help": "Tokens per sequence."})
    steps: int = field(default=3, metadata={"help": "Timed steps (after the profiler's warm-up steps)."})
    device: str = field(
        default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu", metadata={"help": "cuda or cpu."}
    )
    checkpointing: str = field(
        default="both",
        metadata={"choices": ["off", "on", "both"], "help": "Activation checkpointing of the drafter's layers."},
    )
    output: str = field(default="runs/step_check", metadata={"help": "Folder of step_check.json."})
    one: bool = field(default=False, metadata={"help": "Internal: run one setting here and print it as JSON."})


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(StepCheckArguments, prog="python -m moa_hf.training.step_check")
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    if args.one:
        setting = (args.target_config, args.batch_size, args.seq_len, args.steps, args.checkpointing == "on")
        print("@@step_check@@ " + json.dumps(run_setting(*setting, args.device)), flush=True)
        return {}
    results = []
    for on in {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]:
        cmd = [sys.executable, "-m", "moa_hf.training.step_check", "--one", "--checkpointing", "on" if on else "off"]
        cmd += ["--target-config", args.target_config, "--batch-size", str(args.batch_size)]
        cmd += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("@@step_check@@ ")]
        if proc.returncode != 0 or not lines:
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            results.append({"activation_checkpointing": on, "error": f"exit {proc.returncode}: {tail}"})
            print(f"checkpointing {on}: failed (exit {proc.returncode})\n{tail}", file=sys.stderr)
            continue
        result = json.loads(lines[-1].split(" ", 1)[1])
        results.append(result)
        print(
            f"{args.target_config} on {result['device']}, batch {args.batch_size} x {args.seq_len}, checkpointing "
            f"{on}: {result['train_tokens_per_second']:.0f} train tokens/s, peak {result['peak_memory_gib']} GiB "
            f"({result['peak_memory_kind']})"
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_check.json").write_text(json.dumps(results, indent=1))
    return {"results": results}


if __name__ == "__main__":
    main()
