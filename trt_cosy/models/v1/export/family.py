"""The CosyVoice 1 build steps: its torch modules, export plans, preset speakers and test model."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Final

from ....builder.build_family import BuildFamily
from ....builder.export import ExportResult, GraphPlan, Progress, export_graphs
from ....builder.quantize.policies import DATA_MAX, LOGITS, NORMS, STFT, PrecisionPolicy
from ....builder.spk2info import SPK2INFO_FILE, read_spk2info, write_speakers
from ....family_lookup import FAMILIES
from ....runtime.engines import SPEAKERS_NAME
from ....runtime.model import LoadedModel
from .. import graphs as graphs_v1
from ..tokenizer import V1_TOKENIZER_FILE
from .reference import export_plans_v1, load_torch_model_v1
from .testmodel import write_release_v1

__all__ = ["V1BuildFamily"]

_LOGGER = logging.getLogger(__name__)

# ORT-vs-torch export tolerance of the v1 graphs (scaled max error, as export.TOLERANCES).
_V1_TOLERANCES: Final = {graphs_v1.V1_HIFT.name: 1e-3}
_V1_DEFAULT_TOLERANCE: Final = 1e-4


class V1BuildFamily(BuildFamily):
    family = FAMILIES["v1"]
    precision_policies = {
        graphs_v1.V1_TEXT_ENCODER.name: PrecisionPolicy(modules=NORMS, data_max=DATA_MAX),
        graphs_v1.V1_LLM.name: PrecisionPolicy(modules=NORMS, scopes=LOGITS, data_max=DATA_MAX),
        graphs_v1.V1_FLOW_ENCODER.name: PrecisionPolicy(modules=NORMS, data_max=DATA_MAX),
        graphs_v1.V1_FLOW_ESTIMATOR.name: PrecisionPolicy(modules=NORMS, data_max=DATA_MAX),
        graphs_v1.V1_HIFT.name: PrecisionPolicy(
            modules=NORMS | STFT | {"F0Predictor", "SineGenSource"}, data_max=DATA_MAX
        ),
    }

    def load_torch_model(
        self, model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
    ) -> LoadedModel:
        return load_torch_model_v1(model_dir, threads=threads)

    def copy_text_tokenizer(self, model_dir: Path, tokenizer_dir: Path) -> None:
        """Copy whisper's ``multilingual.tiktoken`` (put next to ``cosyvoice.yaml``) into ``tokenizer_dir``."""
        source = Path(model_dir) / V1_TOKENIZER_FILE
        if not source.is_file():
            _LOGGER.warning(
                "%s has no %s (openai-whisper's whisper/assets/%s): the engines carry no text tokenizer; "
                "copy it next to cosyvoice.yaml and rebuild before synthesising",
                model_dir,
                V1_TOKENIZER_FILE,
                V1_TOKENIZER_FILE,
            )
            return
        tokenizer_dir.mkdir(exist_ok=True)
        shutil.copy2(source, tokenizer_dir / V1_TOKENIZER_FILE)

    def export_plan(self, config: Any, name: str) -> GraphPlan:
        return export_plans_v1(config)[name]

    def export(self, model: LoadedModel, out_dir: Path, progress: Progress | None = None) -> dict[str, ExportResult]:
        plans = export_plans_v1(model.config)
        return export_graphs(
            model,
            out_dir,
            graphs_v1.V1_GRAPHS,
            plans.__getitem__,
            lambda name: _V1_TOLERANCES.get(name, _V1_DEFAULT_TOLERANCE),
            progress,
        )

    def write_extra_data(self, model: LoadedModel, model_dir: Path, staging: Path) -> None:
        """The preset speakers of ``spk2info.pt`` (CosyVoice-300M-SFT/-Instruct), when the release has them."""
        if (Path(model_dir) / SPK2INFO_FILE).is_file():
            speakers = read_spk2info(Path(model_dir) / SPK2INFO_FILE, model.config.llm.spk_embed_dim)
            write_speakers(speakers, staging / SPEAKERS_NAME)
            _LOGGER.info("preset speakers: %s", ", ".join(speakers))

    def write_test_release(self, root: Path, size: str, seed: int) -> None:
        write_release_v1(root, size, seed)
