"""Scale-out: `accelerate launch` with 2 CPU processes (gloo), DDP and FSDP2, trains the drafter exactly like one
process with the combined batch (same logged losses, same final weights), on target states the main process caches
once."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moa_hf.training import build_dataset, default_prompts

from factory import tiny_target, tiny_tokenizer

pytestmark = pytest.mark.slow  # two processes with gloo (~25 s): `make test-all`

ACCELERATE = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")


def _train_cmd(target: Path, data: Path, out: Path, batch_size: int, states: Path) -> list[str]:
    return [
        "-m",
        "moa_hf.training.cli",
        "train",
        "--target",
        str(target),
        "--data",
        str(data),
        "--states",
        str(states),
        "--bf16",
        "false",  # float32: one process and two agree to rounding
        "--output",
        str(out),
        "--max-steps",
        "4",
        "--batch-size",
        str(batch_size),
        "--lr",
        "1e-3",
        "--cpu",
        "--quiet",
        "--logging-steps",
        "1",
        "--save-steps",
        "4",
        "--eval-prompts",
        "none",
    ]


def _run(cmd: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def _free_port() -> int:
    """A free local TCP port for the rendezvous (the default 29500 may still be held by an earlier run)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(out: Path) -> dict[int, float]:
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The tiny target's folder, its data, and one process's 4 steps at batch 8 (what both launches must match)."""
    tmp_path = tmp_path_factory.mktemp("one_process")
    target, tokenizer = tiny_target(initializer_range=0.02, logit_scale=30.0), tiny_tokenizer()
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "data"
    build_dataset(
        target,
        tokenizer,
        [p[:40] for p in default_prompts(32)],
        data,
        max_new_tokens=16,
        batch_size=16,
        progress=False,
    )
    out = tmp_path / "single"
    _run([sys.executable, *_train_cmd(folder, data, out, batch_size=8, states=tmp_path / "states1")], tmp_path)
    return folder, data, out, tmp_path / "states1"


def _launch(launcher: list[str], single, out: Path, states: Path, tmp_path: Path) -> str:
    """2 CPU processes (gloo) through `accelerate launch` with `launcher`'s options, batch 4 each."""
    folder, data, _, _ = single
    # accelerate 1.x: `--cpu` with several processes expects MPI; without GPUs, its torchrun processes use gloo on the
    # CPU (and `--cpu` of `moa train` keeps them there).
    common = ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    common += ["--main_process_port", str(_free_port())]
    cmd = [ACCELERATE, "launch", *launcher, *common, *_train_cmd(folder, data, out, batch_size=4, states=states)]
    return _run(cmd, tmp_path)


def _same_training(one: Path, two: Path) -> None:
    """Same logged losses at every step and the same final weights (float32, to rounding)."""
    state = json.loads((two / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["epoch"] == pytest.approx(1.0)  # 2 processes x 4 examples per step over 32 examples
    first, second = _losses(one), _losses(two)
    assert sorted(first) == sorted(second) == [1, 2, 3, 4]
    for step in first:
        assert second[step] == pytest.approx(first[step], rel=1e-4)
    w1, w2 = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(ACCELERATE is None, reason="needs the `accelerate` command")
def test_two_process_ddp_matches_one_process(single, tmp_path):
    log = _launch(["--multi_gpu"], single, tmp_path / "ddp", tmp_path / "states2", tmp_path)
    # the target's states: computed by the main process alone (the other waits, then reads them), as one process would
    assert log.count("Caching the target's states") == 1
    for name in ("target_kv.npy", "final_hidden.npy"):
        assert (tmp_path / "states2" / name).read_bytes() == (single[3] / name).read_bytes()
    _same_training(single[2], tmp_path / "ddp")


@pytest.mark.skipif(ACCELERATE is None, reason="needs the `accelerate` command")
def test_two_process_fsdp_matches_one_process_and_saves_a_loadable_drafter(single, tmp_path):
    """FSDP2 sharding the drafter's SA/CA/LSA layers (docs/training.md's command): the losses and weights of one
    process, and a saved drafter that loads and drafts."""
    fsdp = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"]
    fsdp += ["--fsdp_transformer_layer_cls_to_wrap", "MoADecoderLayer,MoACrossAttentionLayer"]
    fsdp += ["--fsdp_state_dict_type", "FULL_STATE_DICT"]
    _launch(fsdp, single, tmp_path / "fsdp", tmp_path / "states3", tmp_path)
    _same_training(single[2], tmp_path / "fsdp")
    import moa_hf

    target, tokenizer = moa_hf.load_target(single[0], dtype="float32")
    drafter = moa_hf.load_drafter(tmp_path / "fsdp").attach(target)
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    plain = target.generate(ids, do_sample=False, max_new_tokens=8)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=drafter), plain)


@pytest.mark.skipif(ACCELERATE is None, reason="needs the `accelerate` command")
def test_two_process_deepspeed_zero2_matches_one_process(single, tmp_path):
    """DeepSpeed ZeRO-2 through `accelerate launch --use_deepspeed` (its CPU accelerator, gloo): the losses and weights
    of one process, and a saved drafter that loads. Needs `pip install deepspeed` (the `deepspeed` extra)."""
    pytest.importorskip("deepspeed")
    _launch(["--use_deepspeed", "--zero_stage", "2"], single, tmp_path / "zero2", tmp_path / "states4", tmp_path)
    _same_training(single[2], tmp_path / "zero2")
    import moa_hf

    assert moa_hf.load_drafter(tmp_path / "zero2").config.target_fingerprint
