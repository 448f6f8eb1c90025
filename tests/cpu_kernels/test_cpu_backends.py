"""CPU expert backends against a float64 reference, for 1, 7 and 64 tokens and ragged assignments."""

import pytest
import torch

from cpu_kernels.base import reference_experts
from cpu_kernels.isa import kt_kernel_installed
from cpu_kernels import torch_backend
from cpu_kernels.torch_backend import TorchCpuBackend

E, K, H, I = 16, 4, 128, 64

needs_kt = pytest.mark.skipif(not kt_kernel_installed(), reason="kt_kernel is not installed")


def make_backend(name):
    if name == "torch":
        return TorchCpuBackend()
    from cpu_kernels.kt_backend import KtKernelBackend

    return KtKernelBackend(E, K, H, I, threads=2)


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    return gate_up, down


@pytest.mark.parametrize("name", ["torch", pytest.param("kt-kernel", marks=needs_kt)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_backend_matches_float64_reference(name, tokens, experts):
    gate_up, down = experts
    backend = make_backend(name)
    backend.add_layer(5, gate_up, down)
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    ids[::2, 1] = -1        # ragged: some pairs are computed elsewhere
    ids[1::3, 2:] = -1
    weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    out = backend.submit(5, hidden, ids, weights).wait()
    ref = reference_experts(hidden, ids, weights, gate_up, down)
    assert out.shape == (tokens, H) and out.dtype == hidden.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2  # BF16 operands


def test_torch_backend_reads_weights_in_place(experts):
    gate_up, down = experts
    backend = TorchCpuBackend()
    backend.add_layer(0, gate_up.clone(), down)
    hidden, ids, weights = torch.randn(1, H).bfloat16(), torch.tensor([[0, 1, 2, 3]]), torch.full((1, K), 0.25)
    before = backend.submit(0, hidden, ids, weights).wait()
    backend.layers[0][0].mul_(2)  # the store's memory changes: the next result must see it
    after = backend.submit(0, hidden, ids, weights).wait()
    assert not torch.allclose(before, after)
    assert backend.host_bytes == 0


def test_torch_backend_for_a_model_on_the_cpu_computes_in_the_callers_thread(experts):
    """Where the model runs on the CPU, a worker thread would keep an OpenMP team of its own spinning on the
    cores the model's ops need: the share is computed at submit, in the caller's thread, with the same result."""
    import threading

    gate_up, down = experts
    seen = []
    hidden, ids, weights = torch.randn(3, H).bfloat16(), torch.tensor([[0, 1, 2, 3], [4, 5, -1, 6], [7, 0, 1, -1]]), \
        torch.full((3, K), 0.25)
    results = {}
    for in_caller in (False, True):
        backend = TorchCpuBackend(in_caller=in_caller)
        backend.add_layer(0, gate_up, down)
        original = torch_backend.pair_experts
        torch_backend.pair_experts = lambda *a: (seen.append((in_caller, threading.current_thread())), original(*a))[1]
        try:
            task = backend.submit(0, hidden, ids, weights)
            results[in_caller] = task.wait()
        finally:
            torch_backend.pair_experts = original
    assert [caller for caller, _ in seen] == [False, True]
    assert seen[0][1] is not threading.current_thread() and seen[1][1] is threading.current_thread()
    assert torch.equal(results[False], results[True])
    assert "caller's thread" in TorchCpuBackend(in_caller=True).describe()


@needs_kt
def test_kt_kernel_keeps_its_own_copy_and_accounts_for_it(experts):
    gate_up, down = experts
    backend = make_backend("kt-kernel")
    source = gate_up.clone()
    backend.add_layer(0, source, down)
    hidden, ids, weights = torch.randn(1, H).bfloat16(), torch.tensor([[0, 1, 2, 3]]), torch.full((1, K), 0.25)
    before = backend.submit(0, hidden, ids, weights).wait()
    source.mul_(2)  # kt-kernel repacked the weights at load: changing the source changes nothing
    after = backend.submit(0, hidden, ids, weights).wait()
    assert torch.equal(before, after)
    assert backend.host_bytes == E * 3 * I * H * 2


@needs_kt
def test_kt_kernel_refuses_shapes_that_crash_it():
    from cpu_kernels.kt_backend import KtKernelBackend

    with pytest.raises(ValueError, match="multiples of 32; this model has 96 and 40"):
        KtKernelBackend(8, 2, 96, 40)
