from __future__ import annotations

import pytest
import torch
from quant_helpers import gaussian_kv, heavy_tailed_kv


@pytest.fixture(scope="session")
def gaussian() -> torch.Tensor:
    return gaussian_kv()


@pytest.fixture(scope="session")
def heavy() -> tuple[torch.Tensor, torch.Tensor]:
    return heavy_tailed_kv()
