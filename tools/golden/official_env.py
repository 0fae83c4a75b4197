"""Run the official CosyVoice code on the tiny test checkpoints (golden-making scripts only, not product).

Run with the separate official environment, not trt-cosy's venv::

    /work/official-venv/bin/python tools/golden/<script>.py ...

The environment (made once; see docs/golden.md): ``python3 -m venv /work/official-venv``;
``pip install torch==2.13.0`` (CPU wheel); ``pip install --no-deps torchaudio==2.11.1`` with its three
CUDA-linked ``lib/*.so`` moved out (``/work/official-venv/torchaudio-cuda-libs``: ``kaldi.fbank`` and
``Resample`` are pure torch, the extension is not needed); ``pip install "setuptools<70" wheel`` and
then ``pip install --no-build-isolation openai-whisper==20231117 numpy==1.26.4 transformers==4.51.3
diffusers==0.29.0 conformer==0.3.2 HyperPyYAML==1.2.3 omegaconf==2.3.0 inflect==7.3.1 librosa==0.10.2
soundfile onnxruntime onnx einops x-transformers==2.11.24 tqdm scipy pyyaml safetensors``.
The official tree is FunAudioLLM/CosyVoice at ``OFFICIAL_COMMIT`` with Matcha-TTS at ``MATCHA_COMMIT``
unpacked in ``$COSYVOICE_OFFICIAL`` (default ``/work/official-cosyvoice``; ``COMMIT`` files name them).

What is shimmed (``install()``), and nothing numerical:

* ``modelscope``: a module whose ``snapshot_download`` raises (the model directory always exists here);
* ``matcha.utils.__init__`` (imports hydra, lightning, ...): replaced by an empty package over the real
  folder, so ``matcha.utils.audio`` (the official mel) is imported for real, and
  ``matcha.utils.pylogger`` (imports lightning for ``get_pylogger``) by ``logging.getLogger``;
* ``torchaudio.load``: torchaudio 2.11 decodes through torchcodec; replaced by torchaudio 2.3.1's
  soundfile-backend ``load`` (``soundfile.read``, float32, channels first), as the golden README §4.4;
* ``ttsfrd`` / ``wetext``: absent, so the official frontend takes its own ``text_frontend = ''`` branch;
* CosyVoice 1's whisper tokenizer reads the model directory's (stand-in) ``multilingual.tiktoken`` instead of
  whisper's bundled one (``whisper_ranks_from``), as trt-cosy does.

``official_model_dir`` assembles the model directory the official ``CosyVoice*`` constructors read: the
golden checkpoint of tests/data (yaml, ``*.pt``, ``CosyVoice-BlankEN``), the yaml's dropped
``get_tokenizer`` / ``allowed_special`` / ``feat_extractor`` entries copied verbatim from the official
example config, and the stand-in ``campplus.onnx`` / speech tokenizer ONNX files and test text-tokenizer
files of ``trt-cosy make-test-model --size tiny --seed 0`` (the same files trt-cosy's tests use, so both
sides get the same inputs; their sha256 goes into every golden's meta). ``load_official`` then builds
the object with the official constructor; for CosyVoice2 with the one construction-time substitution of
golden README §1.3 (the encoder's look-ahead and upsample layers at the encoder width, not 512).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import types
from pathlib import Path

OFFICIAL_COMMIT = "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"
MATCHA_COMMIT = "dd9105b34bf2be2230f4aa1e4769fb586a3c824e"
OFFICIAL = Path(os.environ.get("COSYVOICE_OFFICIAL", "/work/official-cosyvoice"))
REPO = Path(os.environ.get("TRT_COSY_REPO") or Path(__file__).resolve().parents[2])  # a trt-cosy checkout
DATA = REPO / "tests" / "data"
GOLDEN_DIRS = {"v1": DATA / "cosyvoice1-tiny", "v2": DATA / "cosyvoice2-tiny", "v3": DATA / "cosyvoice3-tiny"}
YAML_NAMES = {"v1": "cosyvoice.yaml", "v2": "cosyvoice2.yaml", "v3": "cosyvoice3.yaml"}
EXAMPLE_CONFS = {
    "v1": "examples/libritts/cosyvoice/conf/cosyvoice.yaml",
    "v2": "examples/libritts/cosyvoice2/conf/cosyvoice2.yaml",
    "v3": "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml",
}
TOKENIZER_ONNX = {
    "v1": "speech_tokenizer_v1.onnx",
    "v2": "speech_tokenizer_v2.onnx",
    "v3": "speech_tokenizer_v3.onnx",
}
# the stand-in frontend files and text-tokenizer files taken from a make-test-model release of the family
EXTRAS = {
    "v1": ("campplus.onnx", "speech_tokenizer_v1.onnx", "multilingual.tiktoken"),
    "v2": (
        "campplus.onnx",
        "speech_tokenizer_v2.onnx",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ),
    "v3": (
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ),
}
STANDINS = ("campplus.onnx",)  # + TOKENIZER_ONNX[family]: hashed into the golden meta


def install() -> None:
    """Put the official tree on ``sys.path`` and install the import-time shims (idempotent)."""
    for commit_file, commit in (
        (OFFICIAL / "COMMIT", OFFICIAL_COMMIT),
        (OFFICIAL / "third_party/Matcha-TTS/COMMIT", MATCHA_COMMIT),
    ):
        found = commit_file.read_text().strip() if commit_file.is_file() else "(no COMMIT file)"
        if found != commit:
            raise SystemExit(f"{commit_file}: expected {commit}, found {found}")
    for path in (OFFICIAL, OFFICIAL / "third_party" / "Matcha-TTS"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if "modelscope" not in sys.modules:
        modelscope = types.ModuleType("modelscope")

        def snapshot_download(model_id, *args, **kwargs):
            raise RuntimeError(f"no downloads here: {model_id} is not a local directory")

        modelscope.snapshot_download = snapshot_download
        sys.modules["modelscope"] = modelscope
    if "matcha.utils" not in sys.modules:
        import matcha

        utils = types.ModuleType("matcha.utils")
        utils.__path__ = [str(Path(matcha.__file__).parent / "utils")]
        sys.modules["matcha.utils"] = utils
        matcha.utils = utils
        pylogger = types.ModuleType("matcha.utils.pylogger")  # the real one imports lightning for a logger
        pylogger.get_pylogger = logging.getLogger
        sys.modules["matcha.utils.pylogger"] = pylogger
        utils.pylogger = pylogger
    import torchaudio

    if getattr(torchaudio.load, "__name__", "") != "soundfile_load":
        torchaudio.load = soundfile_load


def soundfile_load(path, *args, **kwargs):
    """torchaudio 2.3.1's soundfile-backend ``load`` (defaults): float32 [channels, N], sample rate."""
    import soundfile
    import torch

    with soundfile.SoundFile(str(path), "r") as file:
        data = file.read(dtype="float32", always_2d=True)  # [N, C]
        rate = file.samplerate
    return torch.from_numpy(data.T.copy()), rate


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _yaml_block(text: str, key: str) -> str:
    """The top-level ``key:`` entry of a yaml file, with its indented lines."""
    lines, block = text.splitlines(), []
    for index, line in enumerate(lines):
        if line.startswith(f"{key}:"):
            block.append(line)
            for follow in lines[index + 1 :]:
                if follow and not follow[0].isspace():
                    break
                block.append(follow)
            return "\n".join(block)
    raise KeyError(key)


def official_model_dir(family: str, extras: Path, out: Path) -> Path:
    """The golden tiny checkpoint + official frontend config + stand-ins, as a release directory."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(
        GOLDEN_DIRS[family], out, ignore=shutil.ignore_patterns("reference.npz", "MANIFEST.json", "*.npz")
    )
    for name in EXTRAS[family]:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(extras / name, out / name)
    example = (OFFICIAL / EXAMPLE_CONFS[family]).read_text(encoding="utf-8")
    blocks = [_yaml_block(example, key) for key in ("get_tokenizer", "allowed_special", "feat_extractor")]
    yaml = out / YAML_NAMES[family]
    yaml.write_text(
        yaml.read_text(encoding="utf-8")
        + "\n# official frontend entries, verbatim from "
        + EXAMPLE_CONFS[family]
        + "\n"
        + "\n".join(block.rstrip() for block in blocks)
        + "\n",
        encoding="utf-8",
    )
    return out


def standin_hashes(family: str, model_dir: Path) -> dict[str, str]:
    return {name: sha256(model_dir / name) for name in (*STANDINS, TOKENIZER_ONNX[family])}


@contextlib.contextmanager
def _encoder_at_its_width():
    """Golden README §1.3: ``UpsampleConformerEncoder`` builds its look-ahead and upsample layers at
    512 channels whatever its width; build them at ``output_size`` (the same classes and forward)."""
    import cosyvoice.transformer.upsample_encoder as encoder

    real_init, real_pre, real_up = (
        encoder.UpsampleConformerEncoder.__init__,
        encoder.PreLookaheadLayer,
        encoder.Upsample1D,
    )

    def init(self, *args, **kwargs):
        width = kwargs.get("output_size", 256)
        encoder.PreLookaheadLayer = lambda in_channels, channels, pre_lookahead_len=1: real_pre(
            in_channels=width, channels=width, pre_lookahead_len=pre_lookahead_len
        )
        encoder.Upsample1D = lambda channels, out_channels, stride=2: real_up(
            channels=width, out_channels=width, stride=stride
        )
        try:
            real_init(self, *args, **kwargs)
        finally:
            encoder.PreLookaheadLayer, encoder.Upsample1D = real_pre, real_up

    encoder.UpsampleConformerEncoder.__init__ = init
    try:
        yield
    finally:
        encoder.UpsampleConformerEncoder.__init__ = real_init


def whisper_ranks_from(model_dir: Path) -> None:
    """CosyVoice 1's text tokenizer (``whisper.tokenizer.get_tokenizer``) reads whisper's own
    ``multilingual.tiktoken``; read the model directory's instead (the test release's stand-in ranks,
    the file trt-cosy's tests read), with whisper's code for everything else."""
    import builtins

    import whisper.tokenizer as tokenizer

    standin = str(Path(model_dir) / "multilingual.tiktoken")

    def open_standin(path, *args, **kwargs):
        chosen = standin if str(path).endswith("multilingual.tiktoken") else path
        return builtins.open(chosen, *args, **kwargs)

    tokenizer.open = open_standin  # the module's global ``open``, used by get_encoding only
    tokenizer.get_encoding.cache_clear()
    tokenizer.get_tokenizer.cache_clear()


def load_official(family: str, model_dir: Path):
    """The official ``CosyVoice`` / ``CosyVoice2`` / ``CosyVoice3`` object on ``model_dir`` (fp32, CPU)."""
    install()
    import matcha.utils.audio
    from cosyvoice.cli.cosyvoice import CosyVoice, CosyVoice2, CosyVoice3

    # Matcha's mel caches its Hann window and filterbank under str(fmax) + device only: a second family
    # in the same process (v1 1024-point, v2 1920-point, both fmax 8000) would get the first one's.
    matcha.utils.audio.mel_basis.clear()
    matcha.utils.audio.hann_window.clear()

    if family == "v1":
        whisper_ranks_from(model_dir)
        return CosyVoice(str(model_dir))
    if family == "v2":
        with _encoder_at_its_width():
            return CosyVoice2(str(model_dir))
    return CosyVoice3(str(model_dir))
