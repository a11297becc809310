"""`moa_hf.loading`: one policy for loading targets and drafters (dispatch by model_type, dtype, errors, no remote
code)."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import moa_hf
from moa_hf import EagleDrafterConfig, EagleDrafterModel, MoADrafterModel
from moa_hf.loading import drafter_kind, folder_kind, load_drafter, load_target, parse_dtype

from factory import tiny_target, tiny_tokenizer

MARKER = "remote_code_ran.txt"
# Python that leaves a marker file when it is imported: loading must never execute it.
EVIL_CODE = f"""
import pathlib

pathlib.Path(__file__).with_name("{MARKER}").write_text("executed")
from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel
"""


def _independent(vocab_size: int = 100) -> LlamaForCausalLM:
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    """One saved folder per drafter kind, and the target's folder with its tokenizer."""
    root = tmp_path_factory.mktemp("loading")
    torch.manual_seed(0)
    models = {
        "moa": moa_hf.build_drafter(target),
        "eagle": EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config)),
        "independent": _independent(),
    }
    for kind, model in models.items():
        model.save_pretrained(root / kind)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return {kind: root / kind for kind in [*models, "target"]}


# ---------------------------------------------------------------------------------------------------------------------
# dtype
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("half", torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("auto", None),
        (None, None),
    ],
)
def test_parse_dtype(text, dtype):
    assert parse_dtype(text) is dtype


def test_parse_dtype_unknown_name_says_what_to_use():
    with pytest.raises(ValueError, match="Unknown dtype 'fp8'.*bfloat16"):
        parse_dtype("fp8")


@pytest.mark.parametrize(
    "flags, fast, warns",
    [
        (["avx2"], torch.float32, True),  # an AVX2-only CPU: bf16 products take torch's fallback path
        ([], torch.float32, True),
        (["avx512_bf16", "avx512f", "avx2"], torch.bfloat16, False),
        (["amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"], torch.bfloat16, False),
    ],
)
def test_fast_dtype_and_the_emulated_bf16_warning_follow_the_cpu_flags(folders, monkeypatch, flags, fast, warns):
    import warnings

    from moa_hf import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    assert moa_hf.fast_dtype("cpu") is fast
    message = hardware.emulated_bf16_warning(torch.bfloat16, "cpu")
    assert (message is not None) is warns
    assert hardware.emulated_bf16_warning(torch.float32, "cpu") is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = moa_hf.load_target(folders["target"], dtype="bfloat16", device="cpu")
        moa_hf.load_target(folders["target"], dtype="float32", device="cpu")
    assert model.dtype is torch.bfloat16  # a warning, never a silent change of what was asked for
    said = [str(w.message) for w in caught if "native bf16" in str(w.message)]
    assert len(said) == int(warns)
    if warns:
        assert "dtype='float32'" in said[0] and "slower than float32" in said[0]


# ---------------------------------------------------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, cls", [("moa", MoADrafterModel), ("eagle", EagleDrafterModel), ("independent", LlamaForCausalLM)]
)
def test_each_kind_dispatches_by_model_type(folders, target, kind, cls):
    assert folder_kind(folders[kind]) == kind
    drafter = load_drafter(str(folders[kind]))
    assert type(drafter) is cls and drafter_kind(drafter) == kind and not drafter.training
    assert drafter.dtype == torch.float32  # as saved
    on_target = load_drafter(folders[kind], target=target.to(torch.bfloat16), kind=kind)
    target.float()
    assert on_target.dtype == torch.bfloat16 and on_target.device == target.device  # follows the target
    explicit = load_drafter(folders[kind], target=target, dtype="float16")
    assert explicit.dtype == torch.float16  # an explicit dtype wins over the target's


def test_kind_mismatch_and_unknown_kind(folders):
    with pytest.raises(ValueError, match="holds a 'eagle' drafter, not a 'moa' one"):
        load_drafter(folders["eagle"], kind="moa")
    with pytest.raises(ValueError, match="Unknown drafter kind"):
        load_drafter(folders["moa"], kind="medusa")
    assert drafter_kind(load_drafter(folders["moa"], kind="auto")) == "moa"


def test_independent_drafter_needs_the_target_vocabulary(tmp_path, target):
    _independent(vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="64 output tokens but the target has 100"):
        load_drafter(tmp_path, target=target)


def test_a_built_model_passes_through(target):
    drafter = moa_hf.build_drafter(target).eval()
    assert load_drafter(drafter) is drafter and drafter.dtype == torch.float32  # untouched without a placement
    assert load_drafter(drafter, dtype="bf16") is drafter and drafter.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a 'eagle' one"):
        load_drafter(drafter, kind="eagle")


def test_missing_folders_say_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json.*moa train"):
        load_drafter(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(tmp_path / "empty")


def test_default_drafter():
    if not (moa_hf.default_drafter_path() / "config.json").is_file():
        with pytest.raises(FileNotFoundError, match="No trained default drafter"):
            load_drafter("default")
        return
    drafter = load_drafter("default", dtype=torch.float32)
    assert isinstance(drafter, MoADrafterModel) and drafter.dtype == torch.float32
    assert isinstance(moa_hf.load_default_drafter(), MoADrafterModel)


def _plant_remote_code(folder, auto_map: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = auto_map
    (folder / "config.json").write_text(json.dumps(config))
    for name in {ref.split(".")[0] for ref in auto_map.values()}:
        (folder / f"{name}.py").write_text(EVIL_CODE)


def test_remote_code_of_an_unknown_model_is_refused_not_executed(tmp_path):
    _independent().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "evil_model"
    (tmp_path / "config.json").write_text(json.dumps(config))
    _plant_remote_code(tmp_path, {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    with pytest.raises(ValueError, match="Cannot load the independent drafter"):
        load_drafter(tmp_path)
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("kind", ["moa", "independent"])
def test_remote_code_next_to_a_known_model_is_ignored(folders, tmp_path, kind):
    """A published drafter folder carries remote code (and `auto_map`): moa_hf loads it with its own classes."""
    import shutil

    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    _plant_remote_code(
        folder,
        {
            "AutoConfig": "configuration_x.XConfig",
            "AutoModel": "modeling_x.XModel",
            "AutoModelForCausalLM": "modeling_x.XModel",
        },
    )
    drafter = load_drafter(folder)
    assert drafter_kind(drafter) == kind and type(drafter).__module__.startswith(("moa_hf", "transformers"))
    assert not (folder / MARKER).exists()


# ---------------------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------------------
def test_load_target_from_a_folder(folders):
    model, tokenizer = load_target(folders["target"], device="cpu")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == torch.float32  # auto on a CPU
    assert tokenizer is not None and tokenizer.vocab_size == tiny_tokenizer().vocab_size
    model, _ = load_target(str(folders["target"]), dtype="bf16", device="cpu", local_files_only=True)
    assert model.dtype == torch.bfloat16


def test_load_target_errors(folders, tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_target(tmp_path / "missing", local_files_only=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="Unknown dtype"):
        load_target(folders["target"], dtype="float8", device="cpu")
    _independent().save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match="No tokenizer"):
        load_target(tmp_path / "no_tokenizer", device="cpu")
    model, tokenizer = load_target(tmp_path / "no_tokenizer", device="cpu", require_tokenizer=False)
    assert tokenizer is None
    _, tokenizer = load_target(tmp_path / "no_tokenizer", device="cpu", tokenizer=folders["target"])
    assert tokenizer.name_or_path == str(folders["target"])  # the tokenizer given, not the model folder's (none)


def test_a_hub_repo_id_loads_from_the_local_hub_cache_only(folders, tmp_path, monkeypatch):
    """A drafter given as a Hub repo id is read from the local Hub cache (as `huggingface-cli download` leaves it);
    one not in the cache is refused with how to get it, never downloaded."""
    import shutil

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # read by snapshot_download at each call
    with pytest.raises(FileNotFoundError, match="local Hub cache.*huggingface-cli download org/moa-drafter"):
        load_drafter("org/moa-drafter")
    repo = tmp_path / "models--org--moa-drafter"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folders["moa"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    drafter = load_drafter("org/moa-drafter", kind="moa")
    assert isinstance(drafter, MoADrafterModel)
    reference = load_drafter(folders["moa"])
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), reference.state_dict().values()))
