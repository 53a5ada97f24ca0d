"""Device selection: the algorithm code asks for a device by name and never branches on it."""

import importlib.util

import pytest
import torch

from diloco_trainer.learner.devices import dist_backend, select_device, sync


def test_cpu_is_always_available_and_auto_picks_something_present():
    assert select_device("cpu") == torch.device("cpu")
    assert select_device("auto").type in ("cpu", "cuda", "xla")
    sync(select_device("cpu"))  # a no-op on CPU, but it must exist for every device
    assert dist_backend(torch.device("cpu")) == "gloo"


def test_an_unknown_device_name_is_a_value_error():
    with pytest.raises(ValueError, match="device must be one of"):
        select_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda"):
        select_device("cuda")


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_asking_for_xla_without_torch_xla_is_a_clear_error():
    with pytest.raises(ValueError, match="torch_xla is not installed"):
        select_device("xla")
