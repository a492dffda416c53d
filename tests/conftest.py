"""Shared test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models: intra-op threads only add handoff cost, which explodes when the cores are busy.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("single_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
