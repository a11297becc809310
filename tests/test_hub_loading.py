"""A published drafter repo loads by repo id from the Hugging Face cache, with and without `moa_hf` installed.

Both repos (a tiny random Llama target with a character tokenizer, and its drafter) are laid out exactly as
`huggingface_hub` stores downloaded repos (`models--org--name/{blobs,snapshots/<commit>,refs/main}`), then a fresh
Python process with HF_HUB_OFFLINE=1 loads them by id. No network is used.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import moa_hf
from moa_hf.hub import build_repo_folder

from factory import make_target

TARGET_ID = "moa-test/tiny-random-llama"
DRAFTER_ID = "moa-test/tiny-random-llama-moa-drafter"


def _blob_name(path: Path) -> str:
    """What the Hub names a cached file's blob: sha256 for LFS files (weights), the git blob sha1 otherwise."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def install_in_hf_cache(folder: Path, repo_id: str, cache: Path) -> Path:
    """Lay out `folder` as a downloaded model repo in the HF cache `cache`; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = hashlib.sha1("".join(_blob_name(p) for p in files).encode()).hexdigest()  # 40 hex, like a git commit
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for path in files:
        blob = repo / "blobs" / _blob_name(path)
        blob.write_bytes(path.read_bytes())
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))  # what huggingface_hub does where it can
        except OSError:
            link.write_bytes(blob.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _char_tokenizer() -> PreTrainedTokenizerFast:
    """A 128-token character tokenizer (no merges), enough to run the model card's usage snippet."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 32 + 124)])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],
    )


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub_loading")
    target = make_target("llama")
    target.config.name_or_path = TARGET_ID  # as if loaded from the Hub: the drafter records this id
    target.save_pretrained(root / "target")
    _char_tokenizer().save_pretrained(root / "target")
    drafter = moa_hf.build_drafter(target)
    drafter.save_pretrained(root / "drafter")
    folder = build_repo_folder(root / "drafter", DRAFTER_ID, root / "repo")
    cache = root / "hub_cache"
    install_in_hf_cache(root / "target", TARGET_ID, cache)
    snapshot = install_in_hf_cache(folder, DRAFTER_ID, cache)
    assert (snapshot / "model.safetensors").is_symlink() or (snapshot / "model.safetensors").is_file()
    remote_code = {"configuration_moa.py", "modeling_moa.py", "drafting.py", "lookup.py"}  # and nothing of moa_hf
    assert remote_code <= {p.name for p in snapshot.iterdir()}
    return cache


# Runs in a fresh interpreter. argv: mode ("remote-code" or "moa_hf"). Prints one JSON line.
_SCRIPT = textwrap.dedent(
    r'''
    import importlib.abc, json, re, sys

    class BlockMoaHf(importlib.abc.MetaPathFinder):
        """Makes `moa_hf` unimportable, as on a machine where it is not installed."""

        def find_spec(self, name, path=None, target=None):
            if name == "moa_hf" or name.startswith("moa_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    mode = sys.argv[1]
    result = {}
    if mode == "remote-code":
        sys.meta_path.insert(0, BlockMoaHf())
        try:
            import moa_hf  # noqa: F401
            result["moa_hf_importable"] = True
        except ModuleNotFoundError:
            result["moa_hf_importable"] = False
    else:
        import moa_hf  # noqa: F401  registers the classes with AutoConfig / AutoModel

    import torch
    from huggingface_hub import constants
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    result["offline"] = constants.HF_HUB_OFFLINE
    target = AutoModelForCausalLM.from_pretrained(TARGET_ID)
    if mode == "remote-code":
        drafter = AutoModel.from_pretrained(DRAFTER_ID, trust_remote_code=True)
    else:
        drafter = AutoModel.from_pretrained(DRAFTER_ID)
    result["drafter_class"] = f"{type(drafter).__module__}.{type(drafter).__name__}"
    drafter.attach(target)
    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 8, 120, 31]])
    with_drafter = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    target_calls = drafter.speculation_stats.target_calls
    drafter.detach()
    alone = target.generate(ids, max_new_tokens=20, do_sample=False)
    result["new_tokens"] = with_drafter.shape[1] - ids.shape[1]
    result["equal"] = torch.equal(with_drafter, alone)
    result["target_calls"] = target_calls

    if mode == "remote-code":  # the model card's usage snippet, exactly as written
        card = open(CARD_PATH, encoding="utf-8").read()
        snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
        scope = {}
        exec(compile(snippet, "README.md", "exec"), scope)
        snippet_drafter, snippet_target, inputs = scope["drafter"], scope["target"], scope["inputs"]
        snippet_drafter.detach()
        alone = snippet_target.generate(**inputs, max_new_tokens=64, do_sample=False)
        result["snippet_equal"] = torch.equal(scope["out"], alone)
        result["snippet_new_tokens"] = scope["out"].shape[1] - inputs["input_ids"].shape[1]
    result["moa_hf_loaded"] = any(name == "moa_hf" or name.startswith("moa_hf.") for name in sys.modules)
    print("RESULT " + json.dumps(result))
    '''
)


def _run(hf_cache: Path, mode: str, tmp_path: Path) -> dict:
    snapshot = next((hf_cache / ("models--" + DRAFTER_ID.replace("/", "--")) / "snapshots").iterdir())
    script = tmp_path / "load_by_repo_id.py"
    header = f"TARGET_ID = {TARGET_ID!r}\nDRAFTER_ID = {DRAFTER_ID!r}\nCARD_PATH = {str(snapshot / 'README.md')!r}\n"
    script.write_text(header + _SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        PYTHONPATH="",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(hf_cache),
        HF_HOME=str(tmp_path / "hf_home"),  # remote code is copied to HF_HOME/modules
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, str(script), mode], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_load_by_repo_id_without_moa_hf(hf_cache, tmp_path):
    """`AutoModel.from_pretrained(repo_id, trust_remote_code=True)` works where moa_hf cannot be imported."""
    result = _run(hf_cache, "remote-code", tmp_path)
    assert result["offline"] is True
    assert result["moa_hf_importable"] is False
    assert result["moa_hf_loaded"] is False
    assert result["drafter_class"].startswith("transformers_modules.")
    assert result["drafter_class"].endswith(".modeling_moa.MoADrafterModel")
    assert result["new_tokens"] == 20
    assert result["target_calls"] > 0  # the drafter was really used
    assert result["equal"] is True
    assert result["snippet_new_tokens"] == 64
    assert result["snippet_equal"] is True


def test_load_by_repo_id_with_moa_hf(hf_cache, tmp_path):
    """With moa_hf imported, the same repo loads without trust_remote_code, as moa_hf's own class."""
    result = _run(hf_cache, "moa_hf", tmp_path)
    assert result["offline"] is True
    assert result["drafter_class"] == "moa_hf.modeling.modeling_moa.MoADrafterModel"
    assert result["new_tokens"] == 20
    assert result["target_calls"] > 0
    assert result["equal"] is True
