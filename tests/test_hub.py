"""Hub repo folders for drafters: model card, folder contents, `moa publish`, upload failures, target checks."""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import moa_hf
from moa_hf import MoADrafterModel, hub_cards, target_signature
from moa_hf.drafter_types import drafter_type
from moa_hf.hub import (
    build_repo_folder,
    card_inputs,
    check_repo_folder,
    drafter_folder,
    load_drafter,
    register,
)

from factory import make_target

# what a published MoA repo's config.json must say (the registry derives it from the classes' modules)
AUTO_MAP = {"AutoConfig": "configuration_moa.MoADrafterConfig", "AutoModel": "modeling_moa.MoADrafterModel"}
REMOTE_CODE_FILES = drafter_type("moa").remote_code_files

TARGET_ID = "moa-test/tiny-random-llama"
REPO_ID = "moa-test/tiny-moa-drafter"
render_card, validate_card_metadata = hub_cards.render_card, hub_cards.validate_card_metadata


@pytest.fixture(scope="module")
def target():
    model = make_target("llama")
    model.config.name_or_path = TARGET_ID
    return model


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    return moa_hf.build_drafter(target)


@pytest.fixture(scope="module")
def drafter_dir(drafter, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "drafter"
    drafter.save_pretrained(path)
    return path


def _metrics(rng: random.Random) -> dict:
    return {
        "acceptance_length": rng.uniform(1.0, 6.0),
        "tokens_per_s": rng.uniform(10.0, 500.0),
        "speedup": rng.uniform(0.5, 4.0),
        "theoretical_speedup": rng.uniform(1.0, 6.0),
    }


def _benchmark(seed: int = 0, target: str = TARGET_ID) -> dict:
    """A benchmark JSON in `moa bench`'s format with arbitrary numbers (the card must quote them as they are)."""
    rng = random.Random(seed)
    return {
        "hardware": {
            "cpu": f"Test CPU {rng.randint(100, 999)}",
            "cores": rng.randint(2, 64),
            "torch": "2.x",
            "device": f"Test GPU {rng.randint(100, 999)}",
        },
        "target": target,
        "dtype": "bfloat16",
        "max_new_tokens": 256,
        "methods": {
            "moa": {"overall": _metrics(rng), "per_category": {"coding": _metrics(rng), "math": _metrics(rng)}},
            "baseline": {"overall": _metrics(rng)},
        },
        "date": "2025-06-01",
    }


TRAINING_INFO = {
    "data": "UltraChat prompts answered by the target",
    "datasets": ["HuggingFaceH4/ultrachat_200k"],
    "tokens": 123_456_789,
    "steps": 4321,
    "wall_time_s": 7200.0,
    "hardware": "1x H100 80GB",
}


def _yaml_header(text: str) -> dict:
    return yaml.safe_load(re.match(r"\A---\n(.*?)\n---\n", text, re.DOTALL).group(1))


# ---------------------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------------------
def test_card_metadata_and_measured_numbers(drafter):
    bench = _benchmark(seed=1)
    card = render_card(drafter, bench, TRAINING_INFO, repo_id=REPO_ID)
    meta = validate_card_metadata(card)
    assert meta == _yaml_header(card.content) == card.data.to_dict()
    assert meta["base_model"] == drafter.config.target_name_or_path == TARGET_ID
    assert meta["library_name"] == "transformers"
    assert set(hub_cards.REQUIRED_TAGS) <= set(meta["tags"])
    assert meta["license"] == "apache-2.0"
    assert meta["datasets"] == TRAINING_INFO["datasets"]
    assert "pipeline_tag" not in meta  # a drafter is no stand-alone text-generation model

    text = card.text
    hw = bench["hardware"]
    for value in (hw["cpu"], f"{hw['cores']} cores", hw["device"], bench["date"], bench["dtype"]):
        assert str(value) in text
    moa = bench["methods"]["moa"]
    for name, metrics in [("overall", moa["overall"]), *moa["per_category"].items()]:
        row = next(line for line in text.splitlines() if line.startswith("|") and name in line)
        assert f"{metrics['acceptance_length']:.2f}" in row
        assert f"{metrics['speedup']:.2f}×" in row
        assert f"{metrics['tokens_per_s']:.1f}" in row
    baseline_row = next(line for line in text.splitlines() if "`baseline`" in line)
    assert f"{bench['methods']['baseline']['overall']['speedup']:.2f}×" in baseline_row
    assert f"{TRAINING_INFO['tokens']:,}" in text and f"{TRAINING_INFO['steps']:,}" in text
    assert "2.0 h" in text and TRAINING_INFO["hardware"] in text
    # the usage snippet names this repo and the target
    assert f'drafter_id = "{REPO_ID}"' in text and f'target_id = "{TARGET_ID}"' in text
    assert "trust_remote_code=True" in text and "assistant_model=drafter" in text


def test_card_without_benchmark_says_no_measurement(drafter):
    card = render_card(drafter.config, repo_id=REPO_ID)  # from a config only
    validate_card_metadata(card)
    speed = card.text.split("## Speed", 1)[1].split("##", 1)[0]
    assert "No measurement is available" in speed
    assert not re.search(r"\d", speed)  # no number at all where measurements would be
    assert "×" not in card.text
    assert "No training information" in card.text
    assert "datasets" not in card.data.to_dict()


def test_card_rejects_inconsistent_inputs(drafter, tmp_path):
    with pytest.raises(ValueError, match="'moa'"):
        bench = _benchmark()
        del bench["methods"]["moa"]
        render_card(drafter, bench, repo_id=REPO_ID)
    with pytest.raises(ValueError, match="measured with target 'other-org/other-model'"):
        render_card(drafter, _benchmark(target="other-org/other-model"), repo_id=REPO_ID)
    with pytest.raises(ValueError, match="license"):
        render_card(drafter, repo_id=REPO_ID, license="my-own-license")
    with pytest.raises(ValueError, match="base_model"):
        render_card(drafter, repo_id=REPO_ID, base_model=str(tmp_path / "local" / "target"))
    with pytest.raises(ValueError, match="repo_id"):
        render_card(drafter, repo_id="not a repo id")
    with pytest.raises(FileNotFoundError, match="benchmark"):
        render_card(drafter, tmp_path / "missing.json", repo_id=REPO_ID)
    text = render_card(drafter, repo_id=REPO_ID).content
    with pytest.raises(ValueError, match="tags lack"):
        validate_card_metadata(text.replace("- drafter\n", "", 1))
    with pytest.raises(ValueError, match="library_name"):
        validate_card_metadata(text.replace("library_name: transformers", "library_name: timm", 1))


# ---------------------------------------------------------------------------------------------------------------------
# Repo folder
# ---------------------------------------------------------------------------------------------------------------------
def test_build_repo_folder_contents(drafter, drafter_dir, target, tmp_path):
    bench_path = tmp_path / "bench.json"
    bench_path.write_text(json.dumps(_benchmark(seed=2)))
    info_path = tmp_path / "training_info.json"
    info_path.write_text(json.dumps(TRAINING_INFO))
    out = build_repo_folder(drafter_dir, REPO_ID, tmp_path / "repo", benchmark=bench_path, training_info=info_path)

    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "configuration_moa.py",
        "modeling_moa.py",
        "drafting.py",
        "chain.py",
        "lookup.py",
        "moa_layers.py",
        "moa_routes.py",
        "moa_state.py",
        "sorted_exits.py",
        "target_cache.py",
        "target_parts.py",
        "custom_generate",  # transformers' custom_generate folder (tests/test_custom_generate.py)
        "model.safetensors",
        "generation_config.json",
        "README.md",
        "moa_benchmark.json",
        "training_info.json",
    }
    assert check_repo_folder(out) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "repo", "training_info.json"]  # no temp left
    for name in REMOTE_CODE_FILES:  # the package's own files, as save_pretrained copied them
        assert (out / name).read_bytes() == (resources.files("moa_hf.modeling") / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["architectures"] == ["MoADrafterModel"]
    assert config["target_name_or_path"] == TARGET_ID  # the drafter records its target ...
    for key, value in target_signature(target.config).items():  # ... and the target's signature
        assert config[key] == value, key
    weights = load_file(out / "model.safetensors")
    state = drafter.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == drafter.generation_config.num_assistant_tokens
    assert json.loads((out / "moa_benchmark.json").read_text()) == _benchmark(seed=2)
    card = (out / "README.md").read_text()
    assert validate_card_metadata(card)["base_model"] == TARGET_ID
    assert f"{_benchmark(seed=2)['methods']['moa']['overall']['acceptance_length']:.2f}" in card


def test_remote_code_files_are_the_modeling_file_and_its_relative_imports():
    """What a repo must hold for `trust_remote_code` (the files transformers copies and loads), no more."""
    from transformers.dynamic_module_utils import get_relative_import_files

    modeling = resources.files("moa_hf.modeling") / "modeling_moa.py"
    needed = {Path(f).name for f in get_relative_import_files(str(modeling))} | {"modeling_moa.py"}
    assert needed == set(REMOTE_CODE_FILES) and {"drafting.py", "lookup.py"} <= needed
    assert drafter_type("moa").auto_map == AUTO_MAP


def test_build_copies_remote_code_for_unregistered_class(drafter, tmp_path):
    class UnregisteredDrafter(MoADrafterModel):  # a class `save_pretrained` does not write remote code for
        _auto_class = None

    plain = UnregisteredDrafter(drafter.config)
    plain.load_state_dict(drafter.state_dict())
    plain.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "modeling_moa.py").exists()  # so build_repo_folder must add it
    out = build_repo_folder(plain, REPO_ID, tmp_path / "repo")
    for name in REMOTE_CODE_FILES:
        assert (out / name).read_bytes() == (resources.files("moa_hf.modeling") / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["MoADrafterModel"]


def test_build_own_embeddings(target, drafter, tmp_path):
    standalone = moa_hf.build_drafter(target, own_embeddings=True)
    emb = {"embed_tokens.weight", "lm_head.weight"}
    kept = build_repo_folder(standalone, REPO_ID, tmp_path / "kept", own_embeddings=True)
    assert emb <= load_file(kept / "model.safetensors").keys()
    assert json.loads((kept / "config.json").read_text())["own_embeddings"] is True
    lean = build_repo_folder(standalone, REPO_ID, tmp_path / "lean", own_embeddings=False)
    lean_weights = load_file(lean / "model.safetensors")
    assert not emb & lean_weights.keys()
    assert all(torch.equal(lean_weights[k], v) for k, v in standalone.state_dict().items() if k not in emb)
    assert json.loads((lean / "config.json").read_text())["own_embeddings"] is False
    with pytest.raises(ValueError, match="copy_embeddings_from"):
        build_repo_folder(drafter, REPO_ID, tmp_path / "none", own_embeddings=True)


def test_an_eagle_drafter_gets_a_card_and_repo_of_its_kind(target, tmp_path, monkeypatch):
    """The card comes from the drafter-type registry: an EAGLE drafter, made publishable here (the registry does not
    publish EAGLE yet), gets a repo whose card describes EAGLE with the `eagle` method's numbers and nothing of MoA."""
    from dataclasses import replace

    from moa_hf import hub
    from moa_hf.modeling import EagleDrafterConfig, EagleDrafterModel

    eagle = drafter_type("eagle")
    publishable = replace(eagle, publishable=True)
    monkeypatch.setattr(
        hub, "drafter_type", lambda obj: publishable if drafter_type(obj) is eagle else drafter_type(obj)
    )
    torch.manual_seed(0)
    drafter = EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config)).eval()
    bench = _full_benchmark(seed=7, moa_speedup=1.5)  # methods vanilla, moa, eagle, independent, pld
    out = build_repo_folder(drafter, "moa-test/tiny-eagle-drafter", tmp_path / "repo", benchmark=bench)
    assert set(eagle.remote_code_files) <= set(check_repo_folder(out))
    assert json.loads((out / "config.json").read_text())["auto_map"] == eagle.auto_map
    text = (out / "README.md").read_text()
    meta = validate_card_metadata(text)
    assert meta["base_model"] == TARGET_ID and "eagle" in meta["tags"] and "mixture-of-attentions" not in meta["tags"]
    assert text.count("EAGLE") >= 3 and "li2024eagle" in text and "final hidden state" in text  # kind, paper, reads
    assert not re.search("Mixture-of-Attentions|Layer Self-Attention|zimmer2025", text)  # nothing of MoA's
    assert "| Drafter | EAGLE drafter: 1 decoder layer (width 64) |" in text
    overall = bench["methods"]["eagle"]["overall"]
    drafter_rows = _table(_section(text, "## Speed").split("This drafter (`eagle`)", 1)[1], "| Category |")
    assert drafter_rows[1] == [
        "**overall**",
        f"{overall['acceptance_length']:.2f}",
        f"{overall['tokens_per_s']:.1f}",
        f"{overall['speedup']:.2f}×",
        f"{overall['theoretical_speedup']:.2f}×",
    ]
    assert [row[0] for row in _table(text, "| Method |")[1:]] == [
        "`vanilla` (target alone)",
        "`moa` (MoA drafter)",
        "**`eagle` (this drafter)**",
        "`independent` (independent draft model)",
        "`pld` (prompt lookup decoding)",
    ]
    moa_only = {k: v for k, v in bench["methods"].items() if k != "eagle"}
    with pytest.raises(ValueError, match="must contain 'eagle'"):
        render_card(drafter, {**bench, "methods": moa_only}, repo_id=REPO_ID)
    with pytest.raises(ValueError, match="not of kind 'independent'.*no `card`"):  # any other causal LM: no card
        render_card(target, repo_id=REPO_ID)


def test_build_refuses_to_clobber(drafter, drafter_dir, tmp_path):
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError):
            build_repo_folder(drafter, REPO_ID, other, overwrite=overwrite)
    assert (other / "notes.txt").read_text() == "keep me"
    out = build_repo_folder(drafter, REPO_ID, tmp_path / "repo")
    with pytest.raises(FileExistsError, match="overwrite"):
        build_repo_folder(drafter, REPO_ID, out)
    (out / "stale.bin").write_text("from an earlier build")
    build_repo_folder(drafter, REPO_ID, out, overwrite=True)
    assert not (out / "stale.bin").exists()
    with pytest.raises(ValueError, match="own folder"):
        build_repo_folder(drafter_dir, REPO_ID, drafter_dir, overwrite=True)


def test_default_drafter_missing_is_clear(tmp_path, monkeypatch):
    """Without a drafter in the default drafter's folder, `default` fails naming the folder and the fix (the loader
    looks the folder up when called: `moa_hf.default_drafter_path` may be replaced)."""
    empty = tmp_path / "default_drafter"
    empty.mkdir()
    monkeypatch.setattr(moa_hf, "default_drafter_path", lambda: empty)
    assert drafter_folder("default") == empty
    for load in (lambda: load_drafter("default"), moa_hf.load_default_drafter):
        with pytest.raises(
            FileNotFoundError, match=f"No trained default drafter at {re.escape(str(empty))}.*moa train"
        ):
            load()


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _publish_cli(argv: list[str]) -> int:
    """`moa publish ...` through this module's `register`, as moa_hf.cli does."""
    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_publish(drafter_dir, tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_benchmark(seed=3)))
    out = tmp_path / "repo"
    assert (
        _publish_cli(
            [
                "publish",
                str(drafter_dir),
                "--repo-id",
                REPO_ID,
                "--out",
                str(out),
                "--benchmark",
                str(bench),
                "--license",
                "mit",
            ]
        )
        == 0
    )
    assert str(out) in capsys.readouterr().out
    assert validate_card_metadata((out / "README.md").read_text())["license"] == "mit"
    with pytest.raises(SystemExit, match="not a saved drafter folder"):
        _publish_cli(["publish", str(tmp_path / "nowhere"), "--repo-id", REPO_ID, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="already exists"):
        _publish_cli(["publish", str(drafter_dir), "--repo-id", REPO_ID, "--out", str(out)])


@pytest.mark.skipif(
    not any(ep.name == "hub" for ep in entry_points(group="moa_hf.commands")),
    reason="the `moa_hf.commands` entry points are not installed: run `pip install -e .`",
)
def test_moa_cli_has_publish(drafter_dir, tmp_path):
    from moa_hf.cli import main

    assert main(["publish", str(drafter_dir), "--repo-id", REPO_ID, "--out", str(tmp_path / "repo")]) == 0
    check_repo_folder(tmp_path / "repo")


# ---------------------------------------------------------------------------------------------------------------------
# Uploading without a Hub: clear failures, no hang (huggingface_hub reads HF_HUB_OFFLINE/HF_ENDPOINT at import, hence
# fresh processes)
# ---------------------------------------------------------------------------------------------------------------------
_CLI = (
    "import argparse, sys; from moa_hf.hub import register; p = argparse.ArgumentParser(prog='moa'); "
    "register(p.add_subparsers(dest='command', required=True)); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def _hub_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}  # no token from here
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
        HF_HUB_DISABLE_TELEMETRY="1",
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def test_push_offline_fails_cleanly(drafter_dir, tmp_path):
    out = tmp_path / "repo"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI,
            "publish",
            str(drafter_dir),
            "--repo-id",
            REPO_ID,
            "--out",
            str(out),
            "--push",
            "--token",
            "hf_not_a_real_token",
        ],
        env=_hub_env(tmp_path, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "offline mode is enabled" in proc.stderr and "Unset HF_HUB_OFFLINE" in proc.stderr
    assert f"hf upload {REPO_ID} {out}" in proc.stderr  # says how to upload the folder it built
    check_repo_folder(out)


_PUSH = textwrap.dedent(
    """
    import json, sys
    from moa_hf.hub import push_folder
    messages = {}
    for case, token in (("no_token", None), ("no_network", "hf_not_a_real_token")):
        try:
            push_folder(sys.argv[1], sys.argv[2], token=token)
            messages[case] = None
        except RuntimeError as err:
            messages[case] = str(err)
    print(json.dumps(messages))
    """
)


def test_push_unauthenticated_or_unreachable_fails_cleanly(drafter, tmp_path):
    out = build_repo_folder(drafter, REPO_ID, tmp_path / "repo")
    # a closed local port stands in for an unreachable huggingface.co, so nothing leaves this machine
    env = _hub_env(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    proc = subprocess.run(
        [sys.executable, "-c", _PUSH, str(out), REPO_ID], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "not authenticated" in messages["no_token"] and "hf auth login" in messages["no_token"]
    assert "HF_TOKEN" in messages["no_token"]
    assert "no connection" in messages["no_network"] and "http://127.0.0.1:9" in messages["no_network"]
    assert f"hf upload {REPO_ID} {out}" in messages["no_network"]


# ---------------------------------------------------------------------------------------------------------------------
# The saved drafter serves the target it records
# ---------------------------------------------------------------------------------------------------------------------
def test_attach_to_other_target_needs_matching_signature_and_opt_in(drafter_dir, target):
    drafter = MoADrafterModel.from_pretrained(drafter_dir)
    assert drafter.config.target_name_or_path == TARGET_ID

    renamed = make_target("llama", seed=1)  # same signature, another model
    renamed.config.name_or_path = "someone/llama-finetune"
    with pytest.raises(ValueError, match="allow_other_target=True"):
        drafter.attach(renamed)
    assert not drafter.is_attached
    ids = torch.tensor([[1, 5, 9, 77, 3, 40]])
    with drafter.attached(renamed, allow_other_target=True):
        out = renamed.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, renamed.generate(ids, max_new_tokens=12, do_sample=False))

    other_shape = make_target("llama", num_hidden_layers=2)
    other_shape.config.name_or_path = TARGET_ID  # even under the recorded name
    for allow in (False, True):
        with pytest.raises(ValueError, match="signature"):
            drafter.attach(other_shape, allow_other_target=allow)
    drafter.attach(target)  # the recorded target itself
    assert drafter.is_attached
    drafter.detach()


# ---------------------------------------------------------------------------------------------------------------------
# Learning curve, all-method comparison and the JSON files next to a drafter
# ---------------------------------------------------------------------------------------------------------------------
METHODS = ("vanilla", "moa", "eagle", "independent", "pld")
CATEGORIES = ("coding", "math", "writing")


def _full_metrics(rng: random.Random, speedup: float | None = None) -> dict:
    return {
        **_metrics(rng),
        **({"speedup": speedup} if speedup is not None else {}),
        "alpha": rng.uniform(0.1, 0.9),
        "gamma": rng.uniform(1.0, 6.0),
        "cost_ratio": rng.uniform(0.01, 0.2),
    }


def _full_benchmark(seed: int, moa_speedup: float, target: str = TARGET_ID) -> dict:
    """A benchmark in the newer `moa bench` format: five methods with per-category numbers, the run's settings."""
    rng = random.Random(seed)
    bench = _benchmark(seed, target)
    bench["methods"] = {
        name: {
            "overall": _full_metrics(rng, moa_speedup if name == "moa" else None),
            "per_category": {cat: _full_metrics(rng) for cat in CATEGORIES},
            "info": {},
        }
        for name in METHODS
    }
    bench.update(questions_per_category=rng.randint(2, 80), max_new_tokens=rng.randint(32, 512))
    return bench


def _curve(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "step": 10 * (i + 1),
            "tokens": 1000 * (i + 1) + rng.randint(0, 999),
            "wall_time_s": 60.0 * (i + 1),
            "acceptance_length": rng.uniform(1.0, 4.0),
        }
        for i in range(n)
    ]


def _section(text: str, heading: str) -> str:
    return text.split(heading + "\n", 1)[1].split("\n#", 1)[0]


def _table(text: str, header_start: str) -> list[list[str]]:
    """Cells of the Markdown table whose header row starts with `header_start` (separator row dropped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return [rows[0], *rows[2:]]


def test_card_learning_curve_and_all_methods(drafter):
    bench = _full_benchmark(seed=5, moa_speedup=0.73)
    info = {**TRAINING_INFO, "learning_curve": _curve(seed=5, n=7), "acceptance_length_heldout": 2.345}
    card = render_card(drafter, bench, info, repo_id=REPO_ID)
    meta = validate_card_metadata(card)
    assert meta["base_model"] == TARGET_ID and meta["library_name"] == "transformers"
    assert {"speculative-decoding", "mixture-of-attentions", "drafter"} <= set(meta["tags"])
    text = card.text

    curve = _table(_section(text, "### Learning curve"), "| Step")
    assert curve[0] == ["Step", "Training tokens", "Wall time", "Held-out acceptance length"]
    assert curve[1:] == [
        [f"{p['step']:,}", f"{p['tokens']:,}", f"{p['wall_time_s'] / 60:.1f} min", f"{p['acceptance_length']:.2f}"]
        for p in info["learning_curve"]
    ]
    assert "Held-out acceptance length (end of training) | 2.35" in text
    assert "[{" not in text  # the curve is a table, not a JSON dump

    speed = _section(text, "## Speed")
    for value in (
        bench["date"],
        bench["dtype"],
        bench["hardware"]["device"],
        f"{bench['hardware']['cores']} cores",
        f"| Max new tokens per prompt | {bench['max_new_tokens']} |",
        f"| Questions per category | {bench['questions_per_category']} |",
    ):
        assert str(value) in speed
    methods = _table(speed, "| Method")
    assert methods[0][:5] == ["Method", "Acceptance length", "Tokens/s", "Speedup", "Theoretical speedup"]
    assert len(methods) == 1 + len(METHODS)
    for name, row in zip(METHODS, methods[1:]):
        overall = bench["methods"][name]["overall"]
        assert f"`{name}`" in row[0]
        assert row[1:8] == [
            f"{overall['acceptance_length']:.2f}",
            f"{overall['tokens_per_s']:.1f}",
            f"{overall['speedup']:.2f}×",
            f"{overall['theoretical_speedup']:.2f}×",
            f"{overall['alpha']:.2f}",
            f"{overall['gamma']:.2f}",
            f"{overall['cost_ratio']:.3f}",
        ]
    per_cat = _table(speed, "| Category | `moa`")
    others = [m for m in METHODS if m != "vanilla"]
    assert per_cat[0] == ["Category", *[f"`{m}`" for m in others]]
    for cat, row in zip(CATEGORIES, per_cat[1:]):
        speedups = [bench["methods"][m]["per_category"][cat]["speedup"] for m in others]
        assert row[0] == cat
        assert [c.strip("*") for c in row[1:]] == [f"{v:.2f}×" for v in speedups]
        assert row[1 + speedups.index(max(speedups))].startswith("**")  # the best in bold

    # honest about a drafter slower than the target alone
    assert "slower than plain decoding" in speed and "0.73×, below 1" in speed
    faster = [m for m in others if m != "moa" and bench["methods"][m]["overall"]["speedup"] > 0.73]
    for m in faster:
        assert f"`{m}` ({bench['methods'][m]['overall']['speedup']:.2f}×)" in speed
    fast = _section(render_card(drafter, _full_benchmark(seed=5, moa_speedup=9.5), repo_id=REPO_ID).text, "## Speed")
    assert "slower than plain decoding" not in fast and "9.50× as fast as the target alone" in fast
    assert "fastest of the 4 speculative methods" in fast


def test_card_long_learning_curve_is_thinned(drafter):
    points = _curve(seed=6, n=hub_cards.card.MAX_CURVE_ROWS * 3 + 1)
    text = render_card(drafter, training_info={"learning_curve": points}, repo_id=REPO_ID).text
    rows = _table(_section(text, "### Learning curve"), "| Step")[1:]
    assert len(rows) == hub_cards.card.MAX_CURVE_ROWS
    assert rows[0][0] == f"{points[0]['step']:,}" and rows[-1][0] == f"{points[-1]['step']:,}"
    assert f"{len(rows)} of\n{len(points)} measurements shown" in text


def test_card_old_jsons_without_new_keys(drafter):
    info = json.loads((moa_hf.default_drafter_path() / "training_info.json").read_text())
    info.pop("learning_curve", None)
    bench = _benchmark(seed=7)  # no alpha / gamma / cost_ratio, no questions_per_category, no vanilla
    card = render_card(drafter, bench, info, repo_id=REPO_ID)
    validate_card_metadata(card)
    text = card.text
    assert "Learning curve" not in text and "α" not in text and "Questions per category" not in text
    assert f"{info['tokens']:,}" in text
    with pytest.raises(ValueError, match="learning_curve"):
        render_card(drafter, training_info={"learning_curve": {"step": 1}}, repo_id=REPO_ID)


def test_publish_uses_jsons_next_to_the_drafter(tmp_path, capsys):
    folder = tmp_path / "default_drafter"
    shutil.copytree(moa_hf.default_drafter_path(), folder)
    target_id = json.loads((folder / "config.json").read_text())["target_name_or_path"]
    bench = _full_benchmark(seed=8, moa_speedup=0.61, target=target_id)
    info = {"kind": "moa", "tokens": 987_654, "learning_curve": _curve(seed=8, n=4)}
    (folder / "benchmark.json").write_text(json.dumps(bench))
    (folder / "training_info.json").write_text(json.dumps(info))

    out = tmp_path / "repo"
    assert _publish_cli(["publish", str(folder), "--repo-id", REPO_ID, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"benchmark from {folder / 'benchmark.json'}" in printed
    assert f"training info from {folder / 'training_info.json'}" in printed
    assert json.loads((out / "moa_benchmark.json").read_text()) == bench
    assert json.loads((out / "training_info.json").read_text()) == info
    card = (out / "README.md").read_text()
    assert validate_card_metadata(card)["base_model"] == target_id
    assert f"{bench['methods']['pld']['overall']['tokens_per_s']:.1f}" in card
    assert f"{info['learning_curve'][-1]['acceptance_length']:.2f}" in card and "987,654" in card
    assert "slower than plain decoding" in card and "0.61×" in card
    api = build_repo_folder(folder, REPO_ID, tmp_path / "repo_api")  # the Python API picks them up as well
    assert json.loads((api / "moa_benchmark.json").read_text()) == bench
    assert (api / "README.md").read_text() == (out / "README.md").read_text()

    # explicit flags win over the folder's files
    other_bench = _full_benchmark(seed=9, moa_speedup=1.87, target=target_id)
    other_info = {"tokens": 123_123}
    (tmp_path / "b.json").write_text(json.dumps(other_bench))
    (tmp_path / "i.json").write_text(json.dumps(other_info))
    out2 = tmp_path / "repo2"
    argv = ["publish", str(folder), "--repo-id", REPO_ID, "--out", str(out2), "--benchmark", str(tmp_path / "b.json")]
    assert _publish_cli([*argv, "--training-info", str(tmp_path / "i.json")]) == 0
    assert json.loads((out2 / "moa_benchmark.json").read_text()) == other_bench
    assert json.loads((out2 / "training_info.json").read_text()) == other_info
    card = (out2 / "README.md").read_text()
    assert "1.87×" in card and "123,123" in card and "987,654" not in card and "Learning curve" not in card


def test_card_inputs_of_default_drafter(tmp_path):
    folder = moa_hf.default_drafter_path()
    expected = [
        next((folder / n for n in names if (folder / n).is_file()), None)
        for names in (("benchmark.json", "bench.json", "moa_benchmark.json"), ("training_info.json",))
    ]
    assert drafter_folder("default") == folder
    assert list(card_inputs("default")) == expected
    given = {"tokens": 1}
    assert card_inputs("default", benchmark=tmp_path / "b.json", training_info=given) == (tmp_path / "b.json", given)
    assert card_inputs(tmp_path / "nowhere") == (None, None)


def test_card_says_whether_prompt_lookup_is_on(drafter):
    assert "Prompt lookup is on" not in render_card(drafter, repo_id=REPO_ID).text
    config = drafter.config
    config.lookup_num_tokens, config.lookup_min_ngram = 10, 2
    try:
        text = render_card(drafter, repo_id=REPO_ID).text
        from_config = render_card(config, repo_id=REPO_ID).text  # the config alone says the same
        config.lookup_halve_per_ngram = True
        halving = render_card(drafter, repo_id=REPO_ID).text
    finally:
        config.lookup_num_tokens, config.lookup_min_ngram, config.lookup_halve_per_ngram = 0, 1, False
    assert "Prompt lookup is on (in the drafter's config: `lookup_num_tokens` = 10" in text
    assert "`lookup_min_ngram` = 2" in text and "`lookup_min_ngram` = 2" in from_config
    assert "lookup_halve_per_ngram" not in text and "lookup_halve_per_ngram` on" in halving


def test_card_shows_totals_over_continued_runs(drafter):
    info = {
        **TRAINING_INFO,
        "previous_runs": [{"tokens": 1000, "steps": 10}],
        "total_tokens": 123_457_789,
        "total_steps": 4331,
        "total_wall_time_s": 7300.0,
    }
    text = render_card(drafter, training_info=info, repo_id=REPO_ID).text
    assert "| Training tokens, all runs | 123,457,789 |" in text and "| Optimizer steps, all runs | 4,331 |" in text
    assert "previous_runs" not in text and "Previous runs" not in text


def test_card_says_what_of_the_target_the_drafter_reads(drafter, target):
    """The card names the final hidden states and the newest-context path only for a drafter that has them."""
    plain = render_card(drafter, repo_id=REPO_ID).text
    assert "final hidden state" not in plain and "newest verified context" not in plain
    torch.manual_seed(0)
    both = moa_hf.build_drafter(target, context_final_hidden=True, ca_latest_context=True)
    text = render_card(both, repo_id=REPO_ID).text
    assert "target layers) and final hidden states, and borrows" in text
    assert "adds a projection of the target's final hidden state" in text and "newest verified context" in text


def test_card_training_measurements_are_labelled_and_rounded(drafter):
    info = {"top1_heldout": 0.37441619097042034, "acceptance_heldout_by_target": {"main": {"default": 1.45042492917}}}
    text = render_card(drafter, training_info=info, repo_id=REPO_ID).text
    assert "| Held-out top-1 agreement with the target | 0.374 |" in text
    assert "| Held-out acceptance length per target | main 1.45 |" in text and "0.3744" not in text
    info = {  # a run of two targets: the pooled measurements say so; counts and exits read as text, not JSON
        "targets": {"main": "default", "pydoc": "default:pydoc"},
        "acceptance_length_heldout": 1.8594,
        "tokens_per_target": {"main": 3639441, "pydoc": 261779},
        "acceptance_heldout_by_target": {"main": {"default": 1.575, "exit1": 1.4}, "pydoc": {"default": 2.2735}},
        "trainable_parameters": 12937664,
        "acceptance_eval_time_s": 57.3,
        "cached_target_states": {"main": False, "pydoc": True},  # main online, pydoc from --states
    }
    text = render_card(drafter, training_info=info, repo_id=REPO_ID).text
    assert "| Held-out acceptance length (end of training), pooled over the targets | 1.86 |" in text
    assert "| Training tokens per target | main 3,639,441; pydoc 261,779 |" in text
    assert "| Held-out acceptance length per target | main 1.57 (exit1 1.40); pydoc 2.27 |" in text
    assert "| Trainable parameters | 12,937,664 |" in text and "| 57 s |" in text
    assert "| Trained on cached target states | main no (online); pydoc yes |" in text
    assert '{"' not in text.split("## Training")[1].split("## Citation")[0]
