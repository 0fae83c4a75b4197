"""The batched decode step for TensorRT (``llm_decode``, plain ONNX), checked on CPUs.

1. The exported graph, run by ONNX Runtime's CPU provider, against the batch-1 ``llm`` graph row by
   row (fp32, golden tiny CosyVoice2 checkpoint): a batch of mixed prompt lengths whose slot padding is
   NaN gives each row's logits within 1e-4 and its new keys/values; greedy tokens over many steps are
   those of each request decoded alone.
2. The TensorRT side over fakes (``trt_fakes.FakeEngine`` whose "engine" runs that same ONNX graph on
   ONNX Runtime, fake CUDA whose device memory is host memory): device KV slots laid out
   [2L, S, H, C, Dh], one 3D copy per row to add, move and write new positions, the cache inputs bound
   by address, the profile picked by batch size and position bucket, and ``build_stages``' choice of
   the batched stage, whose concurrent greedy requests equal decoding alone.

What only a GPU shows (plan build, per-step latency against B, fp16 token equality) is in
scripts/gpu_check.sh.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from _support import require_build_extra
from test_trt_runtime import FakeCuda
from trt_fakes import FAKE_TRT, CountingCuda, FakeEngine

from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.batch import DeviceKVSlots, TrtBatchLLM
from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
from trt_cosy.runtime.kv_slots import PrefillCache
from trt_cosy.runtime.llm_decode import LLM_DECODE_NAME, cache_input_names, device_cache_inputs
from trt_cosy.runtime.profiles import ProfileLimits, llm_decode_profiles
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.sampling import greedy_sample

TOL = 1e-4  # fp32: a row decoded in a batch against the same request decoded alone
PROMPTS = (7, 19, 3, 12)  # mixed prompt lengths of one batch


@pytest.fixture(scope="module")
def exported(tmp_path_factory, v2_tiny_dir):
    """The plain ``llm`` export (as a TensorRT engines directory has it) and ``llm_decode``."""
    require_build_extra()
    from trt_cosy.builder.export import export_graph, graph_export_plan
    from trt_cosy.builder.trt.llm_decode import export_llm_decode
    from trt_cosy.models.v2.export.reference import load_torch_model_v2
    from trt_cosy.runtime import graphs

    model = load_torch_model_v2(v2_tiny_dir, threads=1)
    out = tmp_path_factory.mktemp("llm_decode")
    plan = graph_export_plan(graphs.LLM.name, model.config)
    module = model.runners[graphs.LLM.name].module
    export_graph(
        graphs.LLM, module, plan.sample, out / "llm.onnx", plan.dynamic_shapes, parity_inputs=plan.parity
    )
    result = export_llm_decode(module, model.config, out)
    decode = OrtRunner.from_path(out / f"{LLM_DECODE_NAME}.onnx", LLM_DECODE_NAME, threads=1, exported=True)
    return SimpleNamespace(
        vocab=decode.infer(_tiny_feed(model.config))["logits"].shape[2],  # V of the speech head
        dir=out,
        config=model.config,
        tables=model.llm_tables,
        errors=result.max_errors,
        llm=OrtRunner.from_path(out / "llm.onnx", "llm", threads=1, exported=True),
        decode=decode,
    )


def _prefill(llm, embeds: np.ndarray) -> dict[str, np.ndarray]:
    spec = llm.input_specs()["past_keys"][0]  # (L, 1, H, P, Dh) with symbolic P
    empty = np.zeros((spec[0], 1, spec[2], 0, spec[4]), np.float32)  # [L, 1, H, 0, Dh]
    return llm.infer({"inputs_embeds": embeds, "past_keys": empty, "past_values": empty})


def _alone_step(llm, keys: np.ndarray, values: np.ndarray, embed: np.ndarray) -> dict[str, np.ndarray]:
    """One step of ``llm`` at batch 1: keys/values [L, 1, H, T, Dh], embed [1, 1, D]."""
    return llm.infer({"inputs_embeds": embed, "past_keys": keys, "past_values": values})


def _slots_with_nan(caches: list[dict[str, np.ndarray]], capacity: int) -> dict[str, np.ndarray]:
    """Per layer [B, H, C, Dh] buffers holding each row's cache, NaN beyond its length."""
    keys0 = caches[0]["present_keys"]  # [L, 1, H, T, Dh]
    layers, _, heads, _, head_dim = keys0.shape
    feed = {}
    for layer in range(layers):
        for kind in ("key", "value"):
            buffer = np.full((len(caches), heads, capacity, head_dim), np.nan, np.float32)  # [B, H, C, Dh]
            for row, cache in enumerate(caches):
                part = cache[f"present_{kind}s"][layer, 0]  # [H, T, Dh]
                buffer[row, :, : part.shape[1]] = part
            feed[f"past_{kind}_{layer}"] = buffer
    return feed


def test_export_matches_torch_and_uses_no_contrib_op(exported):
    import onnx

    assert max(exported.errors.values()) < 1e-5, exported.errors
    model = onnx.load(str(exported.dir / f"{LLM_DECODE_NAME}.onnx"))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}  # TensorRT parses every op
    layers = exported.config.llm.qwen.num_layers
    assert [i.name for i in model.graph.input] == ["inputs_embeds", "past_lengths", "key_positions",
                                                   *cache_input_names(layers)]  # fmt: skip
    assert [o.name for o in model.graph.output] == ["logits", "new_kv"]
    from trt_cosy.builder.trt.llm_decode import llm_decode_plan

    plan = llm_decode_plan(exported.config)  # NaN beyond every row's length (export's parity ignores NaN)
    for feed in (plan.sample, *plan.parity):
        out = exported.decode.infer(feed)
        assert np.isfinite(out["logits"]).all() and np.isfinite(out["new_kv"]).all()


def test_each_row_of_a_mixed_batch_equals_the_batch_1_llm_graph(exported):
    rng = np.random.default_rng(3)
    qwen = exported.config.llm.qwen
    prompts = [rng.standard_normal((1, n, qwen.hidden_size), dtype=np.float32) for n in PROMPTS]
    caches = [_prefill(exported.llm, p) for p in prompts]
    new = rng.standard_normal((len(PROMPTS), 1, qwen.hidden_size), dtype=np.float32)  # [B, 1, D]
    window, capacity = 24, 32  # reads positions < 24 of buffers of 32 (NaN beyond each row's length)
    feed = {
        "inputs_embeds": new,
        "past_lengths": np.asarray(PROMPTS, np.int32),
        "key_positions": np.arange(window, dtype=np.int32),
        **_slots_with_nan(caches, capacity),
    }
    got = exported.decode.infer(feed)
    assert np.isfinite(got["logits"]).all() and np.isfinite(got["new_kv"]).all()  # no NaN leaked
    layers = qwen.num_layers
    for row, (length, cache) in enumerate(zip(PROMPTS, caches, strict=True)):
        alone = _alone_step(exported.llm, cache["present_keys"], cache["present_values"], new[row : row + 1])
        assert np.abs(got["logits"][row, 0] - alone["logits"][0, 0]).max() < TOL, row
        new_keys = alone["present_keys"][:, 0, :, length]  # [L, H, Dh]
        new_values = alone["present_values"][:, 0, :, length]
        assert np.abs(got["new_kv"][row, :layers] - new_keys).max() < TOL, row
        assert np.abs(got["new_kv"][row, layers:] - new_values).max() < TOL, row


def _greedy_alone(exported, prompt: np.ndarray, steps: int) -> list[int]:
    speech = exported.tables["speech_embedding"]  # [V, D]
    out = _prefill(exported.llm, prompt)
    tokens = []
    for _ in range(steps):
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        out = _alone_step(exported.llm, out["present_keys"], out["present_values"], speech[token][None, None])
    return tokens


def test_greedy_tokens_of_a_batch_equal_each_request_alone(exported):
    """Twelve batched steps (new positions written at each row's length) give each row the tokens
    it decodes alone."""
    rng = np.random.default_rng(4)
    qwen, steps = exported.config.llm.qwen, 12
    speech = exported.tables["speech_embedding"]
    prompts = [rng.standard_normal((1, n, qwen.hidden_size), dtype=np.float32) for n in PROMPTS]
    caches = [_prefill(exported.llm, p) for p in prompts]
    slots = _slots_with_nan(caches, capacity=40)
    lengths = np.asarray(PROMPTS, np.int32)
    tokens = [[int(np.argmax(c["logits"][0, -1]))] for c in caches]
    for _ in range(steps - 1):
        embeds = np.stack([speech[t[-1]] for t in tokens])[:, None]  # [B, 1, D]
        window = int(lengths.max())
        feed = {
            "inputs_embeds": embeds,
            "past_lengths": lengths,
            "key_positions": np.arange(window, dtype=np.int32),
        }
        got = exported.decode.infer({**feed, **slots})
        for layer in range(qwen.num_layers):
            for row, length in enumerate(lengths):
                slots[f"past_key_{layer}"][row, :, length] = got["new_kv"][row, layer]
                slots[f"past_value_{layer}"][row, :, length] = got["new_kv"][row, qwen.num_layers + layer]
        lengths = lengths + 1
        for row in range(len(PROMPTS)):
            tokens[row].append(int(np.argmax(got["logits"][row, 0])))
    for row, prompt in enumerate(prompts):
        assert tokens[row] == _greedy_alone(exported, prompt, steps), row


# -- the TensorRT runner's batched path over fakes ---------------------------------------------------


class FakeCuda3D(FakeCuda):
    """``FakeCuda`` plus device-to-device and pitched 3D copies (``cudaMemcpy3DAsync``)."""

    cudaMemcpyKind = SimpleNamespace(
        cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3
    )
    cudaMemcpy3DParms = SimpleNamespace

    @staticmethod
    def make_cudaPitchedPtr(ptr, pitch, xsize, ysize):
        return SimpleNamespace(ptr=ptr, pitch=pitch, xsize=xsize, ysize=ysize)

    @staticmethod
    def make_cudaExtent(width, height, depth):
        return SimpleNamespace(width=width, height=height, depth=depth)

    def cudaMemcpy3DAsync(self, params, stream):
        src, dst, extent = params.srcPtr, params.dstPtr, params.extent
        self.calls.append(("copy3d", params.kind, extent.width, extent.height, extent.depth))
        if extent.width > min(src.pitch, dst.pitch):
            return (self.cudaError_t.cudaErrorMemoryAllocation,)  # the real call rejects it too
        for z in range(extent.depth):
            for y in range(extent.height):
                source = src.ptr + (z * src.ysize + y) * src.pitch
                target = dst.ptr + (z * dst.ysize + y) * dst.pitch
                ctypes.memmove(target, source, extent.width)
        return (self.cudaError_t.cudaSuccess,)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = CountingCuda()  # FakeCuda3D's copies plus CUDA graph capture (the decode step replays one)
    monkeypatch.setattr(cuda, "_BINDINGS", fake)
    return fake


LIMITS = ProfileLimits(max_batch=4, max_context=128, decode_buckets=(64,))


def _fake_decode_runner(exported, slots: int = 1) -> tuple[TrtRunner, FakeEngine]:
    """A TrtRunner over a fake engine that runs the exported ``llm_decode`` graph on ONNX Runtime."""
    qwen = exported.config.llm.qwen
    profiles = llm_decode_profiles(exported.config, LIMITS)
    vocab = exported.vocab

    def output_shape(shapes, name):
        rows = shapes["inputs_embeds"][0]
        return (
            (rows, 1, vocab)
            if name == "logits"
            else (rows, 2 * qwen.num_layers, qwen.num_kv_heads, qwen.head_dim)
        )

    engine = FakeEngine(
        profiles,
        outputs=("logits", "new_kv"),
        compute=lambda views: exported.decode.infer({n: np.array(v) for n, v in views.items()}),
        output_shape=output_shape,
        slots=slots,
        dtypes={"past_lengths": np.int32, "key_positions": np.int32},
    )
    runner = TrtRunner(engine, LLM_DECODE_NAME, profiles, trt=FAKE_TRT, slots=slots,
                       external=device_cache_inputs(profiles.input_names))  # fmt: skip
    return runner, engine


def _tiny_feed(config):
    qwen = config.llm.qwen
    cache = np.zeros((1, qwen.num_kv_heads, 4, qwen.head_dim), np.float32)
    return {"inputs_embeds": np.zeros((1, 1, qwen.hidden_size), np.float32), "past_lengths": np.array([2], np.int32),
            "key_positions": np.arange(2, dtype=np.int32), **dict.fromkeys(cache_input_names(qwen.num_layers), cache)}  # fmt: skip


def test_cache_inputs_get_no_buffers_and_must_be_bound(exported, fake_cuda):
    runner, _ = _fake_decode_runner(exported)
    names = device_cache_inputs(runner.input_names)
    assert names and set(names) == runner.external
    assert not set(names) & set(runner._slots[0].device)  # no device buffer sized for 4 x 128 positions
    from trt_cosy.errors import TrtCosyError

    with pytest.raises(TrtCosyError, match="bound device memory"):
        runner.infer(_tiny_feed(exported.config))


def test_device_slots_add_move_and_write_new_positions(exported, fake_cuda):
    qwen = exported.config.llm.qwen
    layers, heads, head_dim = qwen.num_layers, qwen.num_kv_heads, qwen.head_dim
    slots = DeviceKVSlots(3, layers, heads, 16, head_dim)
    from trt_fakes import host_array

    device = host_array(slots.buffer.ptr, (2 * layers, 3, heads, 16, head_dim))  # [2L, S, H, C, Dh]
    rng = np.random.default_rng(0)
    caches = []
    for length in (5, 9, 2):
        cache = PrefillCache(layers, heads, length, head_dim)
        for part in (*cache.keys, *cache.values):
            part[...] = rng.standard_normal(part.shape)
        caches.append(cache)
        slots.add(cache)
    for row, cache in enumerate(caches):
        for layer in range(layers):
            assert np.array_equal(device[layer, row, :, : cache.length], cache.keys[layer][0])
            assert np.array_equal(device[layers + layer, row, :, : cache.length], cache.values[layer][0])
    addresses = slots.cache_addresses()
    assert addresses["past_key_1"] == slots.buffer.ptr + 1 * 3 * heads * 16 * head_dim * 4
    assert addresses["past_value_0"] == slots.buffer.ptr + layers * 3 * heads * 16 * head_dim * 4
    new_kv = rng.standard_normal((3, 2 * layers, heads, head_dim)).astype(np.float32)  # [B, 2L, H, Dh]
    with cuda.DeviceBuffer(new_kv.nbytes) as buffer, cuda.Stream() as stream:
        host_array(buffer.ptr, new_kv.shape)[...] = new_kv
        slots.write_new(buffer.ptr, 3, stream)
    for row, length in enumerate((5, 9, 2)):
        assert np.array_equal(device[:, row, :, length], new_kv[row])
    assert slots.remove(0) == 2  # the last row (length 2) moves into slot 0
    assert slots.count == 2 and slots.lengths.tolist() == [2, 9, 0]
    assert np.array_equal(device[:layers, 0, :, :2], np.stack([k[0] for k in caches[2].keys]))
    assert sum(1 for call in fake_cuda.calls if call[0] == "copy3d") == 3 + 3 + 1  # one per row and move
    slots.free()


def test_batched_steps_on_the_fake_runner_equal_each_request_alone(exported, fake_cuda):
    """Prefill on ``llm``, join the device slots, step the batch (rows leaving midway): each row's
    greedy tokens are those it decodes alone; profiles follow the batch size and position bucket."""
    runner, engine = _fake_decode_runner(exported)
    qwen = exported.config.llm.qwen
    speech = exported.tables["speech_embedding"]
    model = TrtBatchLLM(exported.llm, runner, qwen.num_layers)
    slots = DeviceKVSlots(4, qwen.num_layers, qwen.num_kv_heads, 128, qwen.head_dim)
    from trt_fakes import host_array

    host_array(slots.buffer.ptr, (slots.nbytes // 4,))[...] = np.nan  # stale memory: must never leak
    stepper = model.decoder(slots, exported.vocab)
    rng = np.random.default_rng(5)
    lengths = (7, 70, 3)  # the 70-position prompt needs the second position bucket (P > 64)
    prompts = [rng.standard_normal((1, n, qwen.hidden_size), dtype=np.float32) for n in lengths]
    tokens = []
    for prompt in prompts:
        cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, prompt.shape[1], qwen.head_dim)
        tokens.append([int(np.argmax(model.prefill(prompt, cache)))])
        slots.add(cache)
    rows = [0, 1, 2]  # request index of each active slot
    selected = []
    for step in range(8):
        embeds = np.stack([speech[tokens[r][-1]] for r in rows])[:, None]  # [B, 1, D]
        logits = stepper.step(embeds)
        selected.append(runner._slots[0].profile)
        for slot, request in enumerate(rows):
            tokens[request].append(int(np.argmax(logits[slot])))
        if step == 3:  # the long request leaves: the short one moves into its slot
            moved = slots.remove(1)
            rows[1] = rows[moved]
            rows.pop()
    assert selected[:4] == [1] * 4 and selected[4:] == [0] * 4  # bucket decode_128, then decode_64
    assert not engine.failures
    expected = [_greedy_alone(exported, p, len(t)) for p, t in zip(prompts, tokens, strict=True)]
    assert tokens == expected
    slots.free()


def test_build_stages_batches_on_a_decode_plan_and_decodes_alone_without(exported, fake_cuda, v2_reference):
    from trt_cosy.models.v2.family import V2Family
    from trt_cosy.stages.trt_llm_batch import TrtBatchedLLMStage

    runner, _ = _fake_decode_runner(exported)
    loaded = SimpleNamespace(
        runners={"llm": exported.llm, "llm_decode": runner}, config=exported.config,
        llm_tables=exported.tables, backend="tensorrt",
    )  # fmt: skip
    stage = V2Family._llm_stage(loaded, None, None)
    assert isinstance(stage, TrtBatchedLLMStage)
    kv = stage.scheduler.slots  # DEFAULT_SLOTS 8 of DEFAULT_POSITIONS 2048, capped by the plan's profiles
    assert (kv.slots, kv.capacity) == (LIMITS.max_batch, LIMITS.max_context)
    assert type(V2Family._llm_stage(loaded, 0, None)) is LLMStage  # batching off
    loaded.runners = {"llm": exported.llm}
    assert type(V2Family._llm_stage(loaded, None, None)) is LLMStage  # engines without llm_decode

    alone = LLMStage(exported.llm, exported.tables, exported.config.llm)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    counts = [30, 6, 18]
    expected = list(alone.generate(*args, greedy_sample, max_new_tokens=max(counts)))
    results: dict[int, list[int]] = {}

    def run(index: int) -> None:
        results[index] = list(stage.generate(*args, greedy_sample, max_new_tokens=counts[index]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(counts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, count in enumerate(counts):
        assert results[index] == expected[:count], index
    deadline = time.monotonic() + 5
    while stage.scheduler.slots.count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stage.scheduler.slots.count == 0 and stage.scheduler.stats.joined == 3
    stage.scheduler.close()


def test_gpu_bench_runs_on_the_fake_runner(exported, fake_cuda, monkeypatch, tmp_path, capsys):
    """bench/trt_llm_decode.py (scripts/gpu_check.sh) end to end on the fakes, so its GPU run only
    meets what is new there: TensorRT, real kernels and timings."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "trt_llm_decode.py"
    spec = importlib.util.spec_from_file_location("trt_llm_decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runner, _ = _fake_decode_runner(exported)
    loaded = SimpleNamespace(runners={"llm": exported.llm, "llm_decode": runner}, config=exported.config,
                             llm_tables=exported.tables)  # fmt: skip
    monkeypatch.setattr(bench, "load_engines", lambda *a, **k: loaded)
    monkeypatch.setattr(bench, "PROMPTS", (9, 40, 17, 5))
    assert bench.main([str(tmp_path), "--steps", "5", "--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["batch"] for r in rows] == [1, 2, 4] and all(
        r["rows_equal_to_batch_1"] == r["batch"] for r in rows
    )
    assert "llm_decode vs llm plan max error" in capsys.readouterr().out


def test_plan_build_adds_the_batch_as_profile_data(tmp_path, v2_tiny_dir):
    """build_plan over the fake tensorrt of test_trt_plan_build: every position bucket of llm_decode is
    added once per slot, each with the batch B 1/4/8 on every batched input and the window P bucketed."""
    from test_trt_plan_build import fake_tensorrt

    from trt_cosy.builder.trt import plans as trt_build
    from trt_cosy.models.registry import read_release_config

    config = read_release_config(v2_tiny_dir)
    profiles = llm_decode_profiles(config)
    names = list(profiles.input_names)
    ranks = {
        n: 3 if n == "inputs_embeds" else 1 if n in ("past_lengths", "key_positions") else 4 for n in names
    }
    trt = fake_tensorrt({"inputs": names, "rank": ranks})
    graph = tmp_path / "llm_decode.onnx"  # the fake parser reads the input names from it
    graph.write_text(json.dumps({"inputs": names}))
    trt_build.build_plan(graph, tmp_path / "llm_decode.plan", profiles, slots=2, trt=trt)
    (built,) = trt.made["configs"]
    assert len(built.profiles) == 2 * 3  # decode_512, decode_2048, decode_4096, once per slot
    qwen = config.llm.qwen
    for index, profile in enumerate(built.profiles):
        shapes = profile.shapes
        assert [s[0] for s in shapes["past_lengths"]] == [1, 4, 8]
        assert [s[0] for s in shapes["inputs_embeds"]] == [1, 4, 8]
        assert shapes["past_key_0"][2] == (8, qwen.num_kv_heads, 4096, qwen.head_dim)  # [B, H, C, Dh]
        assert shapes["key_positions"][2] == ((512, 2048, 4096)[index % 3],)


def test_fixed_shape_steps_give_each_row_its_logits_alone_bit_for_bit(exported, fake_cuda):
    """``fixed_shapes`` (``EngineConfig.deterministic``): every step binds all slots and the whole
    capacity (one profile, one set of shapes, whatever the load), and a row's logits over the fake
    engine are bit-identical alone and beside other rows of other lengths, joining and leaving."""
    runner, engine = _fake_decode_runner(exported)
    qwen = exported.config.llm.qwen
    speech = exported.tables["speech_embedding"]
    model = TrtBatchLLM(exported.llm, runner, qwen.num_layers)
    rng = np.random.default_rng(9)
    prompts = [rng.standard_normal((1, n, qwen.hidden_size), dtype=np.float32) for n in (7, 70, 3)]
    forced = rng.integers(0, speech.shape[0], 6)
    from trt_fakes import host_array

    def decode(members: list[int], leave_after: dict[int, int]) -> dict[int, list[np.ndarray]]:
        slots = DeviceKVSlots(4, qwen.num_layers, qwen.num_kv_heads, 128, qwen.head_dim)
        host_array(slots.buffer.ptr, (slots.nbytes // 4,))[...] = np.nan  # stale memory: must never leak
        stepper = model.decoder(slots, exported.vocab, fixed_shapes=True)
        for index in members:
            cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, prompts[index].shape[1], qwen.head_dim)
            model.prefill(prompts[index], cache)
            slots.add(cache)
        rows, out = list(members), {index: [] for index in members}
        for step in range(forced.size):
            logits = stepper.step(np.stack([speech[forced[step]] for _ in rows])[:, None])
            assert logits.shape == (len(rows), exported.vocab)
            shapes.add((runner._slots[0].profile, runner._slots[0].shapes["inputs_embeds"],
                        runner._slots[0].shapes["key_positions"]))  # fmt: skip
            for row, index in enumerate(rows):
                out[index].append(logits[row].copy())
            for row in sorted((r for r, i in enumerate(rows) if leave_after.get(i) == step), reverse=True):
                moved = slots.remove(row)
                if moved is not None:
                    rows[row] = rows[moved]
                rows.pop()
        slots.free()
        return out

    shapes: set = set()
    alone = {index: decode([index], {})[index] for index in range(3)}
    runs = [decode([0, 1, 2], {1: 2}), decode([2, 0], {})]  # the first: request 1 leaves after 3 steps
    for run in runs:
        for index, rows in run.items():
            assert len(rows) == (3 if index == 1 and len(run) == 3 else forced.size)
            for step, row in enumerate(rows):
                assert np.array_equal(row, alone[index][step]), (index, step)
    (profile, batch, window), = shapes  # one profile and one shape at every step
    assert batch == (4, 1, qwen.hidden_size) and window == (128,)
    assert profile == 1 and not engine.failures
