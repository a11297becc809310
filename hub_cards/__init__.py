"""Model cards for drafter repos on the Hugging Face Hub, of every kind the drafter-type registry gives a card
(template: `drafter_card.md`)."""

from .card import (
    HUB_LICENSES,
    REQUIRED_TAGS,
    TEMPLATE_NAME,
    card_type,
    load_benchmark,
    load_target_benchmarks,
    load_training_info,
    render_card,
    validate_card_metadata,
)

__all__ = [
    "HUB_LICENSES",
    "REQUIRED_TAGS",
    "TEMPLATE_NAME",
    "card_type",
    "load_benchmark",
    "load_target_benchmarks",
    "load_training_info",
    "render_card",
    "validate_card_metadata",
]
