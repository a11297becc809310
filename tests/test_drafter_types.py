"""The drafter-type registry (`moa_hf.drafter_types`): one record per kind, read by loading, training, bench, tune
and the Hub code."""

import pytest
from transformers import LlamaConfig

from moa_hf import EagleDrafterConfig, EagleDrafterModel, MoADrafterConfig, MoADrafterModel, build_drafter, loading
from moa_hf.drafter_types import DrafterType, drafter_kinds, drafter_type, drafter_types, register_drafter_type


def test_the_registered_kinds():
    assert drafter_kinds() == ("moa", "eagle", "independent") == loading.DRAFTER_KINDS
    moa, eagle, independent = drafter_types()
    assert (moa.model_class, moa.config_class, moa.model_type) == (MoADrafterModel, MoADrafterConfig, "moa_drafter")
    assert moa.engine_support and moa.vllm_support and moa.publishable and moa.tunable
    assert eagle.model_class is EagleDrafterModel and eagle.engine_support and not eagle.vllm_support
    assert independent.is_fallback and independent.model_type is None and not independent.engine_support
    # a model card (`moa_hf.hub_cards`) for every kind with classes of its own; a publishable kind needs one
    assert [t.kind for t in drafter_types() if t.card is not None] == ["moa", "eagle"]
    assert all(t.card is not None for t in drafter_types() if t.publishable)


@pytest.mark.parametrize(
    ("obj", "kind"),
    [
        ("moa", "moa"),
        ("eagle", "eagle"),
        (MoADrafterConfig.model_type, "moa"),
        (EagleDrafterConfig.model_type, "eagle"),
        ({"model_type": MoADrafterConfig.model_type}, "moa"),
        ({"model_type": "llama"}, "independent"),
        (MoADrafterModel, "moa"),
        (EagleDrafterConfig, "eagle"),
        (LlamaConfig(), "independent"),
    ],
)
def test_drafter_type_of_names_configs_and_classes(obj, kind):
    assert drafter_type(obj).kind == kind


def test_drafter_type_of_a_model(llama_target):
    drafter = build_drafter(llama_target)
    assert drafter_type(drafter).kind == "moa" and drafter_type(drafter.config).kind == "moa"


def test_unknown_kind_and_double_registration_say_what_to_do():
    with pytest.raises(ValueError, match="use one of moa, eagle, independent"):
        drafter_type("medusa")
    with pytest.raises(ValueError, match="already registered"):
        register_drafter_type(DrafterType("moa", None, None, "x:Y", "x", "x"))
    with pytest.raises(ValueError, match="already the drafter kind 'moa'"):
        register_drafter_type(DrafterType("moa2", MoADrafterModel, MoADrafterConfig, "x:Y", "x", "x"))
    assert drafter_kinds() == ("moa", "eagle", "independent")


def test_training_adapters_come_from_the_registry():
    drafters = pytest.importorskip("moa_hf.training.drafters")
    assert drafters.KINDS == drafter_kinds()
    for record in drafter_types():
        adapter = drafters.adapter_named(record.kind)
        assert adapter.record is record and type(adapter).__name__ == record.training_adapter.rpartition(":")[2]


def test_the_registry_carries_bench_methods_and_remote_code():
    """What varies per kind outside its own files: its `moa bench` methods and flag, its Hub repo's files."""
    moa, eagle, independent = drafter_types()
    assert moa.bench_methods[0] == "moa" and "moa_tree" in moa.bench_methods and moa.bench_default == "default"
    assert (eagle.bench_methods, eagle.bench_default) == (("eagle",), None)
    assert independent.bench_methods == ("independent",)
    assert moa.sorted_exits and not eagle.sorted_exits
    assert {"modeling_moa.py", "configuration_moa.py", "drafting.py"} <= set(moa.remote_code_files)
    assert "modeling_eagle.py" not in moa.remote_code_files and "modeling_eagle.py" in eagle.remote_code_files
    assert eagle.auto_map == {
        "AutoConfig": "configuration_eagle.EagleDrafterConfig",
        "AutoModel": "modeling_eagle.EagleDrafterModel",
    }
    assert independent.remote_code_files == () and independent.auto_map is None


def test_publishing_another_kind_is_refused_by_the_registry(tmp_path):
    from moa_hf.hub import check_repo_folder, publishable_type

    assert publishable_type({"model_type": MoADrafterConfig.model_type}).kind == "moa"
    with pytest.raises(ValueError, match="kind\\(s\\) 'moa' \\(MoA drafter\\), not of kind 'eagle'"):
        publishable_type({"model_type": EagleDrafterConfig.model_type})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not of kind 'independent'"):
        check_repo_folder(tmp_path)
