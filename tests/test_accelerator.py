"""The accelerator object against DeepSpeed's accelerator interface, method by method (CPU),
plus the CUDA class's device-independent answers."""

from __future__ import annotations

import mmap
import time

import psutil
import pytest
import torch

import zerotrain
from zerotrain.accelerator import CPUAccelerator, CUDAAccelerator, get_accelerator, set_accelerator

# Every method and property of DeepSpeed's DeepSpeedAccelerator (accelerator/abstract_accelerator.py,
# deepspeedai/DeepSpeed edaa722, v0.19.6), abstract or not.
DEEPSPEED_ACCELERATOR_API = """
is_synchronized_device use_host_timers resolves_data_dependency handles_memory_backpressure device_name
device set_device current_device current_device_name device_count synchronize random set_rng_state
get_rng_state manual_seed manual_seed_all initial_seed default_generator Stream stream current_stream
default_stream Event empty_cache memory_allocated max_memory_allocated reset_max_memory_allocated
memory_cached max_memory_cached reset_max_memory_cached memory_stats reset_peak_memory_stats
memory_reserved max_memory_reserved total_memory available_memory is_bf16_supported is_fp16_supported
supported_dtypes is_available range_push range_pop lazy_call communication_backend_name
is_triton_supported prefer_triton_grouped_mm create_graph capture_to_graph replay_graph BFloat16Tensor
ByteTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor pin_memory is_pinned unpin_memory
on_accelerator op_builder_dir create_op_builder get_op_builder build_extension export_envs
visible_devices_envs set_visible_devices_envs get_compile_backend set_compile_backend
""".split()


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_ACCELERATOR", "cpu")
    return get_accelerator()


@pytest.mark.parametrize("cls", [CPUAccelerator, CUDAAccelerator])
def test_every_deepspeed_accelerator_method_exists(cls):
    accelerator = cls()  # instantiable: no abstract method left
    missing = [name for name in DEEPSPEED_ACCELERATOR_API if not hasattr(type(accelerator), name)]
    assert missing == []


def test_one_object_reachable_from_the_top_level(cpu):
    assert isinstance(cpu, CPUAccelerator)
    assert zerotrain.get_accelerator() is cpu is get_accelerator()
    from zerotrain.accelerator import DeepSpeedAccelerator

    assert isinstance(cpu, DeepSpeedAccelerator)


def test_device_names_and_counts(cpu, monkeypatch):
    assert cpu.device_name() == cpu.device_name(3) == cpu.current_device_name() == "cpu"
    assert cpu.device() == cpu.device(1) == torch.device("cpu")
    assert cpu.is_available() and cpu.is_synchronized_device() and cpu.use_host_timers()
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert cpu.current_device() == 2
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu.device_count() == 4
    assert cpu.communication_backend_name() == cpu.communication_backend == "gloo"
    cpu.set_device(0)
    cpu.synchronize()
    cpu.synchronize(0)


def test_seeds_and_rng_state(cpu):
    cpu.manual_seed(1234)
    first = torch.rand(4)
    assert cpu.initial_seed() == 1234
    cpu.manual_seed_all(1234)
    assert torch.equal(torch.rand(4), first)
    state = cpu.get_rng_state()
    a = torch.rand(4)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)
    assert cpu.random() is torch.random
    assert cpu.default_generator(0) is torch.default_generator


def test_streams_and_host_events(cpu):
    stream = cpu.Stream()
    with cpu.stream(stream):
        x = torch.ones(8) * 2
    cpu.current_stream().wait_stream(stream)
    assert cpu.default_stream() is not None and float(x.sum()) == 16
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    end.synchronize()
    assert end.query()
    assert 45 <= start.elapsed_time(end) < 1000
    with pytest.raises(RuntimeError, match="enable_timing"):
        cpu.Event().elapsed_time(cpu.Event())


def test_memory_is_the_process_rss(cpu):
    before = cpu.memory_allocated()
    assert abs(before - psutil.Process().memory_info().rss) < 16 * 2**20
    cpu.reset_peak_memory_stats()
    # 64 MiB of fresh pages, touched: an anonymous mapping of its own, so neither the heap that
    # earlier tests in this process left free nor the allocator's mmap threshold can serve it.
    region = mmap.mmap(-1, 64 * 2**20)
    block = torch.frombuffer(region, dtype=torch.float32)
    block.fill_(1.0)
    held = cpu.memory_allocated()
    assert held - before > 48 * 2**20
    del block
    region.close()
    cpu.empty_cache()
    assert cpu.memory_allocated() < held - 48 * 2**20  # freed and returned to the OS
    # The peak since the reset remembers the 64 MiB that is gone.
    assert cpu.max_memory_allocated() >= held > cpu.memory_allocated()
    assert cpu.max_memory_reserved() == cpu.max_memory_allocated()
    assert cpu.memory_cached() <= cpu.max_memory_cached()
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= held
    cpu.reset_max_memory_allocated()
    assert cpu.max_memory_allocated() < held
    assert cpu.total_memory() == psutil.virtual_memory().total
    assert 0 < cpu.available_memory() <= cpu.total_memory()


def test_dtype_queries(cpu):
    assert cpu.is_bf16_supported()
    dtypes = cpu.supported_dtypes()
    assert dtypes[0] == torch.float32 and torch.bfloat16 in dtypes
    # fp16 is reported when torch computes in it here (zerotrain then trains in it on CPU).
    fp16_works = bool(
        torch.nn.functional.layer_norm(
            torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16), (2,)
        )
        .isfinite()
        .all()
    )
    assert cpu.is_fp16_supported() == fp16_works == (torch.float16 in dtypes)


def test_tensors_pinning_and_placement(cpu):
    t = cpu.FloatTensor([1, 2])
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert cpu.LongTensor([1]).dtype == torch.int64 and cpu.HalfTensor([1]).dtype == torch.float16
    assert cpu.BFloat16Tensor([1]).dtype == torch.bfloat16 and cpu.IntTensor([1]).dtype == torch.int32
    assert cpu.ByteTensor([1]).dtype == torch.uint8 and cpu.DoubleTensor([1]).dtype == torch.float64
    assert cpu.pin_memory(t) is t and not cpu.is_pinned(t) and cpu.unpin_memory(t) is None
    assert cpu.on_accelerator(t) and not cpu.on_accelerator(torch.empty(1, device="meta"))


def test_profiler_ranges_and_misc(cpu):
    with torch.profiler.profile() as prof:
        cpu.range_push("zerotrain_range")
        torch.ones(4) @ torch.ones(4)
        cpu.range_pop()
    assert "zerotrain_range" in {e.name for e in prof.events()}
    assert cpu.lazy_call(lambda: 7) == 7
    env: dict = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"} and cpu.export_envs() == []
    assert cpu.get_compile_backend() == "inductor"
    with pytest.raises(ValueError, match="not supported"):
        cpu.set_compile_backend("no-such-backend")
    with pytest.raises(NotImplementedError, match="FusedAdam"):
        cpu.create_op_builder("FusedAdamBuilder")
    assert cpu.create_graph() is None and not cpu.is_triton_supported()
    with cpu.capture_to_graph(None):
        pass


def test_cuda_class_answers_without_a_gpu():
    cuda = CUDAAccelerator()
    assert (cuda.device_name(), cuda.device_name(1)) == ("cuda", "cuda:1")
    assert cuda.device(1) == torch.device("cuda", 1)
    assert cuda.communication_backend_name() == cuda.communication_backend == "nccl"
    assert cuda.export_envs() == ["NCCL"] and not cuda.is_synchronized_device()
    assert cuda.is_available() == torch.cuda.is_available()
    assert cuda.on_accelerator(torch.empty(1, device="meta")) is False


def test_peak_flops_for_mfu(cpu, monkeypatch):
    assert cpu.peak_flops(torch.bfloat16) is None  # the CPU: n/a unless flops_profiler.peak_tflops
    cuda = CUDAAccelerator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, dtype, tflops in (
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.float16, 756.0),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores
        ("NVIDIA A100-SXM4-80GB", torch.float32, None),  # fp32: depends on TF32
        ("NVIDIA GeForce GTX 1080", torch.float16, None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, _name=name: _name)
        assert cuda.peak_flops(dtype) == (tflops * 1e12 if tflops else None), name


def test_choice_from_environment_and_override(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="ZEROTRAIN_ACCELERATOR='tpu'"):
        get_accelerator()
    monkeypatch.delenv("ZEROTRAIN_ACCELERATOR")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator().name == "cpu"
    custom = CPUAccelerator()
    set_accelerator(custom)
    try:
        assert get_accelerator() is custom
    finally:
        set_accelerator(None)
    with pytest.raises(TypeError):
        set_accelerator("cpu")
