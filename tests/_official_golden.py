"""The golden sets made by running the official code (tools/golden/make_*_golden.py, /work/official-venv):
loading them and cutting their input wavs (the draws: ``trt_cosy.verify.official_draws``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
AUDIO = DATA / "features" / "audio"


def load_official_golden(path: Path) -> dict:
    """Arrays of a golden ``.npz`` plus its ``meta`` (the decoded ``meta_json``)."""
    with np.load(path) as data:
        golden = {key: data[key] for key in data.files}
    golden["meta"] = json.loads(str(golden.pop("meta_json")))
    return golden


def cut_wav(spec: dict, out: Path) -> Path:
    """The input wav of a golden: samples [start, end) of a features wav, 16-bit PCM (as the script
    wrote it)."""
    import soundfile

    data, rate = soundfile.read(Path(__file__).parents[1] / spec["file"], dtype="int16", always_2d=True)
    assert rate == spec["rate"]
    soundfile.write(out, data[spec["start"] : spec["end"]], rate, subtype="PCM_16")
    return out
