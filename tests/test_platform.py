"""kvserve.platform: the device from EngineConfig.device, what runs fast there, and the CPU's process tuning."""

import pytest
import torch

from kvserve.cpu_features import has_fast_bf16_matmul
from kvserve.errors import ConfigError
from kvserve.kernels import ops
from kvserve.platform import Platform


def test_a_cpu_platform_knows_its_device_and_what_it_can_do():
    platform = Platform("cpu")
    assert platform.device == torch.device("cpu") and platform.is_cpu
    assert platform.has_cpp_kernels == ops.available()
    assert platform.has_fast_bf16 == has_fast_bf16_matmul()
    assert platform.describe().startswith("cpu: ")
    assert Platform() == platform  # cpu by default; frozen and comparable by name
    platform.tune_process()  # idempotent
    platform.tune_process()


def test_a_cuda_platform_is_named_without_the_cpu_kernels():
    platform = Platform("cuda:1")
    assert platform.device == torch.device("cuda", 1) and not platform.is_cpu
    assert not platform.has_cpp_kernels


@pytest.mark.parametrize("name, message", [("tpu", "not a device name"), ("mps", "'mps' is not supported")])
def test_unknown_devices_are_refused_by_name(name, message):
    with pytest.raises(ConfigError, match=message):
        Platform(name)
