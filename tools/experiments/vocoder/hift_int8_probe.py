"""How fast and how close an OpenVINO HiFT with int8 (VNNI) convolutions would be: a measurement probe.

    python tools/experiments/vocoder/hift_int8_probe.py /tmp/mixed128/hift.xml --frames 500 --runs 6 --threads 2 \\
        --groups hift.resblocks,hift.source_resblocks

Reads the fp32 HiFT graph of OpenVINO or mixed engines (``hift.xml``), calibrates one activation range
per convolution input (min/max over ``--calibration`` random mels of ``--calibration-frames`` frames, seeds
other than the evaluation input's), puts ``FakeQuantize`` (256 levels per activation tensor, 255 levels per
output channel of the weight) in front of every convolution whose weight name starts with one of
``--groups``, and times the quantised graph against the fp32 one, alternating, on a held-out mel. Printed:
median/min seconds per call and the waveform SNR of the quantised graph against fp32 on that mel.

This is a probe, not a build path: the ranges come from random-normal mels, which say nothing about a
real checkpoint's activations (a build would calibrate on the flow's own mels). The f0 predictor is the
numeric island: quantising it moves f0, the NSF source's phase drifts, and the waveform SNR collapses.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _feed(frames: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "mel": rng.normal(-5.0, 2.0, (1, 80, frames)).astype(np.float32),  # [1, 80, F]
        "sine_noise": (rng.standard_normal((1, 480 * frames, 9)) * 0.003).astype(np.float32),  # [1, 480F, 9]
        "cache_source": np.zeros((1, 1, 0), np.float32),  # [1, 1, 0]
    }


def _convolutions(model) -> list:
    return [node for node in model.get_ordered_ops() if node.get_type_name() == "Convolution"]


def _weight_constant(conv):
    node = conv.input_value(1).get_node()
    if node.get_type_name() == "Convert":  # fp16-stored weights
        node = node.input_value(0).get_node()
    return node if node.get_type_name() == "Constant" else None


def _ranges(core, path: str, feeds: list[dict], threads: int) -> list[tuple[float, float]]:
    """Per convolution (graph order): (min, max) of its input over the calibration feeds."""
    model = core.read_model(path)
    convs = _convolutions(model)
    model.add_outputs([conv.input_value(0) for conv in convs])
    request = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads}).create_infer_request()
    low = [np.inf] * len(convs)
    high = [-np.inf] * len(convs)
    for feed in feeds:
        request.infer(feed)
        for index, conv in enumerate(convs):
            values = request.get_tensor(conv.input_value(0).get_any_name()).data
            low[index] = min(low[index], float(values.min()))
            high[index] = max(high[index], float(values.max()))
    return list(zip(low, high, strict=True))


def _quantised(core, path: str, ranges: list[tuple[float, float]], groups: tuple[str, ...]):
    from openvino import opset13 as ops

    model = core.read_model(path)
    count = 0
    for conv, (low, high) in zip(_convolutions(model), ranges, strict=True):
        constant = _weight_constant(conv)
        if constant is None or not constant.get_friendly_name().startswith(groups):
            continue
        weight = constant.get_data().astype(np.float32)  # [Cout, Cin, K]
        low, high = np.float32(min(low, 0.0)), np.float32(max(high, 1e-6))
        activation = ops.fake_quantize(
            conv.input_value(0),
            ops.constant(low),
            ops.constant(high),
            ops.constant(low),
            ops.constant(high),
            256,
        )
        limit = np.maximum(np.abs(weight).max(axis=(1, 2), keepdims=True), 1e-8).astype(
            np.float32
        )  # [Cout, 1, 1]
        kernel = ops.fake_quantize(
            ops.constant(weight),
            ops.constant(-limit),
            ops.constant(limit),
            ops.constant(-limit),
            ops.constant(limit),
            255,
        )
        conv.input(0).replace_source_output(activation.output(0))
        conv.input(1).replace_source_output(kernel.output(0))
        count += 1
    model.validate_nodes_and_infer_types()
    return model, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hift", help="an OpenVINO fp32 hift.xml (OpenVINO or mixed engines)")
    parser.add_argument("--frames", type=int, default=500, help="mel frames of the timed, held-out input")
    parser.add_argument("--calibration", type=int, default=3, help="random mels to calibrate the ranges on")
    parser.add_argument("--calibration-frames", type=int, default=300)
    parser.add_argument("--groups", default="hift.resblocks,hift.source_resblocks")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import openvino as ov

    core = ov.Core()
    groups = tuple(group for group in args.groups.split(",") if group)
    ranges = _ranges(
        core,
        args.hift,
        [_feed(args.calibration_frames, 1 + seed) for seed in range(args.calibration)],
        args.threads,
    )
    config = {
        "INFERENCE_NUM_THREADS": args.threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "PERFORMANCE_HINT": "LATENCY",
    }
    quantised, count = _quantised(core, args.hift, ranges, groups)
    requests = {
        "fp32": core.compile_model(core.read_model(args.hift), "CPU", config).create_infer_request(),
        "int8": core.compile_model(quantised, "CPU", config).create_infer_request(),
    }
    feed = _feed(args.frames, 0)
    waves = {}
    for name, request in requests.items():  # warm-up and output
        request.infer(feed)
        waves[name] = request.get_output_tensor(0).data.copy()  # [1, 480F]
    seconds: dict[str, list[float]] = {name: [] for name in requests}
    for _ in range(args.runs):
        for name, request in requests.items():
            start = time.perf_counter()
            request.infer(feed)
            seconds[name].append(time.perf_counter() - start)
    error = waves["int8"] - waves["fp32"]
    snr = 10 * np.log10(float((waves["fp32"] ** 2).sum()) / max(float((error**2).sum()), 1e-30))
    print(f"quantised convolutions: {count} ({', '.join(groups)}); held-out mel of {args.frames} frames")
    for name, values in seconds.items():
        print(f"{name}: median {np.median(values):.3f} s, min {min(values):.3f} s over {args.runs} calls")
    print(f"waveform SNR int8 vs fp32: {snr:.1f} dB")


if __name__ == "__main__":
    main()
