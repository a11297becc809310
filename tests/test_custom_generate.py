"""A published drafter repo as transformers' `custom_generate`: `target.generate(custom_generate=REPO, ...)`.

The repo folder is built by `build_repo_folder` from a tiny random Llama target's drafter (fp32, greedy). A fresh
Python process (where `moa_hf` cannot be imported, as on a machine without it; remote code copied to a temporary
HF_MODULES_CACHE; offline) runs every transformers-side case once and prints one JSON line; the tests read it.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

import moa_hf
from moa_hf import hub_cards
from moa_hf.hub import CUSTOM_GENERATE_FILES, build_repo_folder, check_repo_folder, publish

from factory import make_target

TARGET_ID = "moa-test/tiny-random-llama"
REPO_ID = "moa-test/tiny-random-llama-moa-drafter"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    model = make_target("llama")
    model.config.name_or_path = TARGET_ID  # the drafter (and its card) records this id
    return model


@pytest.fixture(scope="module")
def built(target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("custom_generate")
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    moa_hf.build_drafter(target).save_pretrained(root / "drafter")
    return {"root": root, "repo": build_repo_folder(root / "drafter", REPO_ID, root / "repo")}


def _recorded(folder: Path) -> dict[str, str | None]:
    """The DRAFTER_* constants `moa publish` wrote into the folder's custom_generate/generate.py."""
    text = (folder / "custom_generate" / "generate.py").read_text(encoding="utf-8")
    found = dict(re.findall(r"^(DRAFTER_REPO|DRAFTER_FOLDER): str \| None = (.+?)  #", text, re.MULTILINE))
    return {name: ast.literal_eval(value) for name, value in found.items()}  # repr()s of str or None


# ---------------------------------------------------------------------------------------------------------------------
# The repo folder (in this process)
# ---------------------------------------------------------------------------------------------------------------------
def test_folder_carries_custom_generate_and_the_tag(built):
    """(d) custom_generate/ holds generate.py (recording the drafter) and every other file of the package's folder
    (the loop and the pages it imports: engine.py, tree.py, accept.py, policy.py), unchanged; the card has the tag."""
    repo = built["repo"]
    package = resources.files("moa_hf.modeling") / "custom_generate"
    files = sorted(p.name for p in package.iterdir() if p.name.endswith(".py") and p.name != "__init__.py")
    assert {"engine.py", "tree.py", "accept.py", "policy.py", "generate.py"} <= set(files)
    assert sorted(CUSTOM_GENERATE_FILES) == [f"custom_generate/{name}" for name in files]
    assert sorted(p.name for p in (repo / "custom_generate").iterdir()) == files
    for name in files:
        if name != "generate.py":
            assert (repo / "custom_generate" / name).read_bytes() == (package / name).read_bytes()
    assert _recorded(repo) == {"DRAFTER_REPO": REPO_ID, "DRAFTER_FOLDER": str(repo.resolve())}
    # generate.py is the package's file with those two lines filled in, nothing else changed
    ours, theirs = (package / "generate.py").read_text().splitlines(), (repo / "custom_generate" / "generate.py")
    changed = [(a, b) for a, b in zip(ours, theirs.read_text().splitlines(), strict=True) if a != b]
    assert [a.split(":")[0] for a, _ in changed] == ["DRAFTER_REPO", "DRAFTER_FOLDER"]
    card = (repo / "README.md").read_text(encoding="utf-8")
    assert "custom_generate" in hub_cards.validate_card_metadata(card)["tags"]
    assert f'target.generate(**inputs, custom_generate="{REPO_ID}", trust_remote_code=True' in card
    assert "custom_generate" in check_repo_folder(repo)


def test_check_repo_folder_requires_custom_generate(built, tmp_path):
    for name in CUSTOM_GENERATE_FILES:
        copy = shutil.copytree(built["repo"], tmp_path / name.replace("/", "_"))
        (copy / name).unlink()
        with pytest.raises(ValueError, match=re.escape(name)):
            check_repo_folder(copy)


def test_pushed_repo_records_no_local_folder(built, tmp_path, monkeypatch):
    """`publish(push=True)` builds the folder first; its generate.py names the Hub repo only (no local path)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the upload then fails at once, after the build
    with pytest.raises(RuntimeError, match="offline mode"):
        publish(built["root"] / "drafter", REPO_ID, tmp_path / "repo", push=True)
    assert _recorded(tmp_path / "repo") == {"DRAFTER_REPO": REPO_ID, "DRAFTER_FOLDER": None}


def test_generate_function_in_process(target, built):
    """The package's own generate.py (nothing recorded): a drafter object as `drafter=`; no drafter: an error."""
    from moa_hf.modeling.custom_generate import generate as custom

    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 8, 120, 31]])
    alone = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    drafter = moa_hf.load_drafter(built["root"] / "drafter", kind="moa")
    mask = torch.ones_like(ids)
    out = custom.generate(
        model=target, inputs=ids, attention_mask=mask, drafter=drafter, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert torch.equal(out, alone)
    assert not drafter.is_attached  # attached for the call only
    with pytest.raises(ValueError, match="Pass drafter="):
        custom.generate(model=target, input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)


# ---------------------------------------------------------------------------------------------------------------------
# Through transformers, in a fresh process without moa_hf
# ---------------------------------------------------------------------------------------------------------------------
# argv: target folder, repo folder, HF_MODULES_CACHE, new tokens. Prints one JSON line.
_SCRIPT = textwrap.dedent(
    r'''
    import functools, importlib.abc, json, sys
    from pathlib import Path

    class BlockMoaHf(importlib.abc.MetaPathFinder):
        """Makes `moa_hf` unimportable, as on a machine where it is not installed."""

        def find_spec(self, name, path=None, target=None):
            if name == "moa_hf" or name.startswith("moa_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, BlockMoaHf())
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    target_dir, repo, modules = sys.argv[1:4]
    n = int(sys.argv[4])
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    one = {"input_ids": torch.tensor([[1, 17, 42, 99, 5, 63, 8, 120, 31]])}
    one["attention_mask"] = torch.ones_like(one["input_ids"])
    two = {  # left-padded batch (pad 0)
        "input_ids": torch.tensor([[0, 0, 0, 1, 64, 7, 7, 90, 12], [1, 17, 42, 99, 5, 63, 8, 120, 31]]),
        "attention_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9]),
    }
    result = {}

    # (e) refused without trust_remote_code, before any of the repo's code is copied or run
    for case, extra in (("trust_absent", {}), ("trust_false", {"trust_remote_code": False})):
        try:
            target.generate(**one, custom_generate=repo, max_new_tokens=4, **extra)
            result[case] = "generated"
        except ValueError as err:
            result[case] = str(err)
    result["copied_before_trust"] = sorted(str(p) for p in Path(modules).rglob("generate.py"))

    # (a) the one-line usage: same tokens as the target alone
    alone = target.generate(**one, max_new_tokens=n)
    spec = target.generate(**one, custom_generate=repo, trust_remote_code=True, max_new_tokens=n)
    result["a_equal"], result["a_new_tokens"] = torch.equal(spec, alone), spec.shape[1] - 9
    alone2 = target.generate(**two, max_new_tokens=n)
    spec2 = target.generate(**two, custom_generate=repo, trust_remote_code=True, max_new_tokens=n)
    result["a_batch_equal"] = torch.equal(spec2, alone2)

    # (b) tree settings and return_dict_in_generate pass through: a chain of 3, then a tree (2 children, 4 nodes)
    for case, top_k, budget in (("b_chain", 1, 3), ("b_tree", 2, 4)):
        out = target.generate(
            **one, custom_generate=repo, trust_remote_code=True, max_new_tokens=n, tree_depth=3, tree_top_k=top_k,
            tree_budget=budget, lookup=False, return_dict_in_generate=True,
        )
        stats = [s.as_dict() for s in out.speculation_stats]
        result[case] = {"equal": torch.equal(out.sequences, alone), "stats": stats}
    module = next(m for name, m in sys.modules.items() if name.endswith("custom_generate.generate"))
    result["loaded_drafters"] = [type(d).__module__ for d in module._LOADED_DRAFTERS.values()]

    # (c) the drafter loaded by hand: its generate is replaced, assisted generation still works
    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True)
    replaced = drafter.generate
    result["c_replaced"] = isinstance(replaced, functools.partial) and replaced.func.__module__ == module.__name__
    assisted = target.generate(**one, assistant_model=drafter.attach(target), max_new_tokens=n)
    result["c_equal"], result["c_drafted"] = torch.equal(assisted, alone), drafter.speculation_stats.drafted_tokens
    drafter.detach()
    out = target.generate(**two, custom_generate=repo, trust_remote_code=True, drafter=drafter, max_new_tokens=n)
    result["c_as_drafter_equal"] = torch.equal(out, alone2)

    result["moa_hf_loaded"] = any(name == "moa_hf" or name.startswith("moa_hf.") for name in sys.modules)
    print("\nRESULT " + json.dumps(result))  # on a line of its own (transformers' trust prompt has no newline)
    '''
)


@pytest.fixture(scope="module")
def through_transformers(built) -> dict:
    root = built["root"]
    (root / "run.py").write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    modules = root / "modules"
    env.update(
        PYTHONPATH="",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(root / "hf_home"),
        HF_MODULES_CACHE=str(modules),  # the repo's remote code is copied here
        HF_HUB_DISABLE_TELEMETRY="1",
        OMP_NUM_THREADS="1",
    )
    args = [str(root / "target"), str(built["repo"]), str(modules), str(NEW_TOKENS)]
    proc = subprocess.run(
        [sys.executable, str(root / "run.py"), *args],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,  # transformers' trust prompt reads stdin: none here, so it refuses at once
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_custom_generate_equals_target_alone(through_transformers):
    """(a) `target.generate(**inputs, custom_generate=REPO, trust_remote_code=True)`: the target's greedy tokens."""
    r = through_transformers
    assert r["a_new_tokens"] == NEW_TOKENS
    assert r["a_equal"] is True
    assert r["a_batch_equal"] is True  # left-padded batch of two
    assert r["moa_hf_loaded"] is False  # the repo's own code only
    assert len(r["loaded_drafters"]) == 1  # loaded once (in the target's dtype and device), then reused
    assert r["loaded_drafters"][0].startswith("transformers_modules.")


@pytest.mark.parametrize("case, budget", [("b_chain", 3), ("b_tree", 4)])
def test_tree_settings_pass_through(through_transformers, case, budget):
    """(b) tree_depth / tree_top_k / tree_budget / lookup and return_dict_in_generate reach the engine."""
    r = through_transformers[case]
    assert r["equal"] is True
    (stats,) = r["stats"]  # one per row
    assert stats["generated_tokens"] == NEW_TOKENS
    assert stats["lookup_tokens"] == 0  # lookup=False
    assert stats["drafted_tokens"] > 0
    assert stats["tree_sizes"] and max(stats["tree_sizes"]) == budget  # tree_budget drafted nodes per cycle


def test_loaded_drafter_keeps_assisted_generation(through_transformers):
    """(c) AutoModel.from_pretrained(REPO, trust_remote_code=True): generate replaced, assistant_model still exact."""
    r = through_transformers
    assert r["c_replaced"] is True
    assert r["c_equal"] is True
    assert r["c_drafted"] > 0
    assert r["c_as_drafter_equal"] is True  # the same drafter object as custom_generate's drafter=


def test_refused_without_trust_remote_code(through_transformers):
    """(e) transformers refuses the repo's custom generate code unless trust_remote_code=True, and copies none."""
    r = through_transformers
    for case in ("trust_absent", "trust_false"):
        assert r[case] != "generated"
        assert "trust_remote_code=True" in r[case], r[case]
    assert r["copied_before_trust"] == []
