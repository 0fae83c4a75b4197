"""The CUDA helpers and TrtRunner's device plumbing on a real GPU (cuda-python and a device; no TensorRT).

TrtRunner is driven here by bench/gpu_plumbing.py's ``CopyEngine``: an engine-like object whose
``execute_async_v3`` queues a device-to-device ``cudaMemcpyAsync`` from the bound input address to
the bound output address on the stream it is given. That exercises, on real device memory, what the CPU tests check with
host-memory fakes: preallocation from profile maxima, pinned staging, address binding, one stream
per slot, several threads sharing slots, and stage-to-stage hand-off through device pointers with
an event and no host synchronisation in between. Marked ``gpu``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

from trt_cosy.runtime.backends.tensorrt import cuda

_NO_CUDA = cuda.cuda_unavailable_reason()

_SPEC = importlib.util.spec_from_file_location(
    "gpu_plumbing", Path(__file__).parents[1] / "bench" / "gpu_plumbing.py"
)
plumbing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plumbing)  # the CopyEngine lives with the benchmark that also uses it

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_NO_CUDA is not None, reason=f"needs an NVIDIA GPU and cuda-python: {_NO_CUDA}"),
]


def _frames(rng: np.random.Generator, frames: int) -> np.ndarray:
    return rng.standard_normal((1, frames, 80)).astype(np.float32)  # [1, T, 80]


def test_device_reports_name_capability_and_memory():
    info = cuda.device_info()
    free, total = cuda.memory_info()
    assert info["name"] and info["compute_capability"].count(".") == 1, info
    assert 0 < free <= total == info["total_memory"], (free, total, info)
    print(f"GPU: {info}, free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")


def test_failed_allocation_names_the_cuda_error():
    with pytest.raises(cuda.CudaError, match="cudaErrorMemoryAllocation") as info:
        cuda.DeviceBuffer(1 << 60)  # an exabyte: no GPU has it
    assert info.value.code == 2, info.value
    with cuda.DeviceBuffer(1 << 20) as buffer:  # the failure is not sticky: the context still works
        assert buffer.ptr


def test_round_trip_through_pinned_device_and_device_copy():
    data = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    nbytes = data.nbytes
    with (
        cuda.PinnedBuffer(nbytes) as host_in,
        cuda.PinnedBuffer(nbytes) as host_out,
        cuda.DeviceBuffer(nbytes) as first,
        cuda.DeviceBuffer(nbytes) as second,
        cuda.Stream() as stream,
    ):
        host_in.view(np.float32, data.shape)[...] = data
        first.copy_from_async(host_in, nbytes, stream)
        second.copy_from_device_async(first.ptr, nbytes, stream)
        second.copy_to_async(host_out, nbytes, stream)
        stream.synchronize()
        assert np.array_equal(host_out.view(np.float32, data.shape), data)


def test_event_orders_work_across_streams_without_host_sync():
    data = np.random.default_rng(1).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    nbytes = data.nbytes
    with (
        cuda.PinnedBuffer(nbytes) as host_in,
        cuda.PinnedBuffer(nbytes) as host_out,
        cuda.DeviceBuffer(nbytes) as staged,
        cuda.DeviceBuffer(nbytes) as copied,
        cuda.Stream() as producer,
        cuda.Stream() as consumer,
        cuda.Event() as ready,
        cuda.Event(timing=True) as start,
        cuda.Event(timing=True) as end,
    ):
        host_in.view(np.float32, data.shape)[...] = data
        host_out.view(np.float32, data.shape)[...] = 0.0
        start.record(producer)
        staged.copy_from_async(host_in, nbytes, producer)
        ready.record(producer)
        consumer.wait(ready)  # the consumer's copy must see the whole upload
        copied.copy_from_device_async(staged.ptr, nbytes, consumer)
        copied.copy_to_async(host_out, nbytes, consumer)
        end.record(consumer)
        end.synchronize()
        assert ready.done() and end.done()
        assert np.array_equal(host_out.view(np.float32, data.shape), data)
        elapsed = end.elapsed_ms(start)
        assert 0.0 < elapsed < 10_000.0, elapsed
        print(
            f"64 MiB up, device copy, down: {elapsed:.2f} ms ({3 * nbytes / elapsed / 1e6:.1f} GB/s overall)"
        )


def test_runner_preallocates_device_memory_once_and_reuses_it():
    before, _ = cuda.memory_info()
    runner = plumbing.copy_runner(slots=2)
    after, _ = cuda.memory_info()
    expected = 2 * 2 * 4096 * 80 * 4  # slots x tensors x max frames x 80 x float32
    assert before - after >= expected, (before, after, expected)
    rng = np.random.default_rng(2)
    for frames in (7, 256, 1000, 4096, 3):
        x = _frames(rng, frames)
        out = runner.infer({"x": x})["y"]
        assert out.shape == x.shape and np.array_equal(out, x), frames
    assert cuda.memory_info()[0] >= after - (64 << 20)  # no growth beyond allocator noise
    runner.free()


def test_runner_slots_serve_threads_concurrently():
    runner = plumbing.copy_runner(slots=3)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            x = _frames(rng, int(rng.integers(1, 4096)))
            if not np.array_equal(runner.infer({"x": x})["y"], x):
                errors.append(f"thread {seed}: wrong output for {x.shape}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.free()
    assert not errors, errors


def test_stage_hand_off_through_device_pointers_and_an_event():
    """Stage A's output buffer is stage B's input: no host copy, no host synchronisation in between."""
    first = plumbing.copy_runner()
    second = plumbing.copy_runner()
    x = _frames(np.random.default_rng(3), 3000)
    first.set_shapes({"x": x.shape})
    first.copy_inputs({"x": x})
    first.enqueue()
    handed = first.record()  # after stage A's launch
    pointer, shape, _ = first.device_tensor("y")
    second.set_shapes({"x": shape})
    second.wait(handed)  # stage B's stream waits on the device, the host goes on
    second.enqueue(addresses={"x": pointer})
    views = second.copy_outputs()
    second.stream().synchronize()
    assert np.array_equal(views["y"], x)
    handed.free()
    first.free()
    second.free()


def test_device_kv_slots_copy_rows_with_3d_copies():
    """runtime.backends.tensorrt.batch's KV slots on real device memory: join (pinned -> device), new positions
    (device -> device, one cudaMemcpy3DAsync per row) and a row move, against the same layout in numpy."""
    from trt_cosy.runtime.backends.tensorrt.batch import DeviceKVSlots
    from trt_cosy.runtime.kv_slots import PrefillCache

    layers, heads, capacity, head_dim, count = 3, 2, 16, 8, 3
    shape = (2 * layers, count, heads, capacity, head_dim)  # [2L, S, H, C, Dh]
    rng = np.random.default_rng(0)
    expected = np.zeros(shape, np.float32)
    slots = DeviceKVSlots(count, layers, heads, capacity, head_dim)
    with cuda.Stream() as stream, cuda.PinnedBuffer(slots.nbytes) as host:
        zeros = host.view(np.float32, shape)
        zeros[...] = 0
        slots.buffer.copy_from_async(host, slots.nbytes, stream)
        stream.synchronize()
        for row, length in enumerate((5, 9, 2)):
            cache = PrefillCache(layers, heads, length, head_dim)
            for layer in range(layers):
                cache.keys[layer][...] = rng.standard_normal(cache.keys[layer].shape)
                cache.values[layer][...] = rng.standard_normal(cache.values[layer].shape)
                expected[layer, row, :, :length] = cache.keys[layer][0]
                expected[layers + layer, row, :, :length] = cache.values[layer][0]
            assert slots.add(cache) == row
        new_kv = rng.standard_normal((count, 2 * layers, heads, head_dim)).astype(np.float32)  # [B, 2L, H, Dh]
        with cuda.PinnedBuffer(new_kv.nbytes) as staged, cuda.DeviceBuffer(new_kv.nbytes) as device:
            staged.view(np.float32, new_kv.shape)[...] = new_kv
            device.copy_from_async(staged, new_kv.nbytes, stream)
            slots.write_new(device.ptr, count, stream)
            stream.synchronize()
        for row, length in enumerate((5, 9, 2)):
            expected[:, row, :, length] = new_kv[row]
        slots.lengths[:count] += 1
        assert slots.remove(0) == 2  # row 2 (3 positions now) moves into slot 0
        expected[:, 0, :, :3] = expected[:, 2, :, :3]
        slots.buffer.copy_to_async(host, slots.nbytes, stream)
        stream.synchronize()
        got = host.view(np.float32, shape)
        np.testing.assert_array_equal(got[:, :2], expected[:, :2])  # slot 2 is free (its data is stale)
    slots.free()
