"""Shared fixtures: tiny random targets of several families (the builders are in `factory`)."""

import pytest
import torch

from factory import FAMILIES, make_target

torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core machine


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def llama_target():
    return make_target("llama")
