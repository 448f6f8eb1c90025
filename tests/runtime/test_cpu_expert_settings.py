"""The rules' CPU settings refuse what the CPU backends cannot do, before any backend is built:
a quantized copy needs kt-kernel, and the layerwise GPU prefill takes only its own formats and shares."""

import pytest

from vismmoe_kt.runtime.budget import BudgetError
from vismmoe_kt.runtime.cpu_expert_settings import CpuExpertSettings
from vismmoe_kt.runtime.offload_settings import OffloadSettings


def test_cpu_experts_quantized_copy_needs_kt_kernel():
    with pytest.raises(ValueError, match="needs cpu_backend kt-kernel"):
        CpuExpertSettings(cpu_backend="torch", cpu_dtype="int8")
    with pytest.raises(ValueError, match="cpu_backend 'onednn' is not one of: auto, kt-kernel, torch"):
        CpuExpertSettings(cpu_backend="onednn")
    assert CpuExpertSettings(cpu_backend="kt-kernel", cpu_dtype="int4").cpu_dtype == "int4"


def test_cpu_experts_gpu_prefill_settings_are_checked():
    with pytest.raises(ValueError, match="gpu_prefill_format 'q2_k' is not one of: auto, model"):
        CpuExpertSettings(gpu_prefill_format="q2_k")
    with pytest.raises(ValueError, match="gpu_prefill_share must be in"):
        CpuExpertSettings(gpu_prefill_share=1.5)
    with pytest.raises(ValueError, match="gpu_prefill_tokens must be 0"):
        CpuExpertSettings(gpu_prefill_tokens=True)
    assert CpuExpertSettings(gpu_prefill_tokens=512, gpu_prefill_format="q4_k", gpu_prefill_share="auto").gpu_prefill_tokens == 512


def test_the_hybrid_modes_quantized_copy_needs_kt_kernel():
    with pytest.raises(BudgetError, match="cpu_dtype int8 needs cpu_backend kt-kernel"):
        OffloadSettings(expert_budget="1GiB", miss_policy="auto", cpu_backend="torch", cpu_dtype="int8")
    with pytest.raises(BudgetError, match="cpu_dtype 'int3' is not one of"):
        OffloadSettings(expert_budget="1GiB", cpu_dtype="int3")
    assert OffloadSettings(expert_budget="1GiB", miss_policy="auto", cpu_backend="kt-kernel", cpu_dtype="int4").cpu_dtype == "int4"
