"""Quantized CPU experts (kt-kernel INT8 / INT4, quantized at load) against a float64 reference, the
on-disk cache that makes the next start skip the quantization, and clear errors for what they cannot do."""

import pytest
import torch

from cpu_kernels.base import reference_experts
from cpu_kernels.isa import kt_kernel_installed

pytestmark = pytest.mark.skipif(not kt_kernel_installed(), reason="kt_kernel is not installed")

E, K, H, I = 16, 4, 256, 128
# relative L2 error of one layer's output on random-normal weights (per-row scales: INT4 is coarse)
STATED_ERROR = {"bf16": 0.01, "int8": 0.03, "int4": 0.30}


def experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    return gate_up, down


def backend(dtype, model_dir=None):
    from cpu_kernels.kt_backend import KtKernelBackend

    return KtKernelBackend(E, K, H, I, threads=1, dtype=dtype, model_dir=model_dir)


def call(b, layer, seed=1, tokens=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    return b.submit(layer, hidden, ids, weights).wait(), (hidden, ids, weights)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_quantized_experts_are_within_the_stated_error(dtype):
    gate_up, down = experts()
    b = backend(dtype)
    b.add_layer(0, gate_up, down)
    out, (hidden, ids, weights) = call(b, 0)
    ref = reference_experts(hidden, ids, weights, gate_up, down)
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error <= STATED_ERROR[dtype], error
    if dtype != "bf16":
        assert error > 1e-4  # really quantized, not a BF16 copy under another name
        assert b.host_bytes == E * 3 * I * H * {"int8": 1, "int4": 0.5}[dtype]


def _checkpoint(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"weights")
    return model_dir


def test_the_next_start_reads_the_cache_and_computes_the_same(tmp_path):
    model_dir = _checkpoint(tmp_path)
    layers = {0: experts(0), 3: experts(3)}
    first = backend("int8", model_dir)
    for layer, tensors in layers.items():
        first.add_layer(layer, *tensors)
    assert first.loaded_from_cache == 0
    root = model_dir / ".vismmoe-cache" / "cpu-int8"
    assert (root / "manifest.json").exists() and (root / "_layer_3.done").exists()
    second = backend("int8", model_dir)
    for layer, tensors in layers.items():
        second.add_layer(layer, *tensors)
    assert second.loaded_from_cache == 2 and "2 of 2 layers read from" in second.describe()
    for layer in layers:
        assert torch.equal(call(first, layer)[0], call(second, layer)[0])


def test_a_changed_checkpoint_or_a_half_written_layer_is_quantized_again(tmp_path):
    model_dir = _checkpoint(tmp_path)
    first = backend("int4", model_dir)
    first.add_layer(0, *experts(0))
    first.add_layer(1, *experts(1))
    root = model_dir / ".vismmoe-cache" / "cpu-int4"
    (root / "_layer_1.done").unlink()  # as if the run had been killed while writing layer 1
    again = backend("int4", model_dir)
    again.add_layer(0, *experts(0))
    again.add_layer(1, *experts(1))
    assert again.loaded_from_cache == 1
    (model_dir / "model.safetensors").write_bytes(b"other weights")  # another checkpoint
    changed = backend("int4", model_dir)
    assert not (root / "_layer_0.done").exists()  # the stale cache was emptied
    changed.add_layer(0, *experts(0))
    assert changed.loaded_from_cache == 0


def test_a_model_without_a_directory_quantizes_in_a_temporary_place_and_keeps_nothing():
    b = backend("int8")
    b.add_layer(0, *experts(0))
    root = b.cache.root
    assert not list(root.glob("_layer_*"))  # deleted once loaded: kt-kernel holds the experts now
    assert "quantized at load" in b.describe()
    del b
    import gc

    gc.collect()
    assert not root.exists()


def test_read_only_checkpoint_directories_cache_under_the_user_cache(tmp_path, monkeypatch):
    from cpu_kernels import quant_cache

    model_dir = _checkpoint(tmp_path)
    real = quant_cache._writable
    monkeypatch.setattr(quant_cache, "_writable", lambda d: model_dir not in d.parents and real(d))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    b = backend("int8", model_dir)
    assert (tmp_path / "cache" / "vismmoe-kt") in b.cache.root.parents
    b.add_layer(0, *experts(0))
    assert b.cache.has(0) and not (model_dir / ".vismmoe-cache" / "cpu-int8" / "_layer_0.done").exists()


def test_what_the_quantized_kernels_cannot_take_is_a_clear_error():
    from cpu_kernels.kt_backend import KtKernelBackend

    with pytest.raises(ValueError, match="int4 experts need .* multiples of 128; this model has 256 and 64"):
        KtKernelBackend(E, K, 256, 64, threads=1, dtype="int4")
    with pytest.raises(ValueError, match="cpu_dtype 'fp3' is not one of: bf16, int8, int4"):
        KtKernelBackend(E, K, H, I, threads=1, dtype="fp3")


def _plan(*threads):
    from cpu_kernels.threads import WorkerPlan

    return WorkerPlan(tuple(range(len(threads))), tuple(threads), sum(threads), None)


def test_the_cache_is_rebuilt_when_the_sub_pools_change_or_a_file_is_gone(tmp_path):
    """kt-kernel's files depend on how many sub-pools split each layer: another worker plan must not
    read them (the manifest records it); a cached layer whose files kt-kernel cannot read is quantized again."""
    from cpu_kernels.kt_backend import KtKernelBackend

    model_dir = _checkpoint(tmp_path)
    tensors = experts(0)
    one = KtKernelBackend(E, K, H, I, threads=_plan(1), dtype="int8", model_dir=model_dir)
    one.add_layer(0, *tensors)
    two = KtKernelBackend(E, K, H, I, threads=_plan(1, 1), dtype="int8", model_dir=model_dir)
    two.add_layer(0, *tensors)
    assert two.loaded_from_cache == 0  # the manifest's layout differs: quantized again
    again = KtKernelBackend(E, K, H, I, threads=_plan(1, 1), dtype="int8", model_dir=model_dir)
    files = [f for f in (again.cache.root / "_layer_0").rglob("*") if f.is_file()]
    files[0].unlink()  # as if part of the layer's files were lost
    again.add_layer(0, *tensors)
    assert again.loaded_from_cache == 0 and again.cache.has(0)
    torch.testing.assert_close(call(again, 0)[0].float(), call(two, 0)[0].float(), rtol=0, atol=0)


def test_sizes_are_checked_per_sub_pool():
    from cpu_kernels.kt_backend import KtKernelBackend

    with pytest.raises(ValueError, match=r"multiples of 128; this model has 256 and 128 split across 2 NUMA sub-pools "
                                         r"\(64 each\)"):
        KtKernelBackend(E, K, 256, 128, threads=_plan(1, 1), dtype="int4")
