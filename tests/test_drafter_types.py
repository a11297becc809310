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
