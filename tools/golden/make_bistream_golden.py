"""Golden set of the official text-in streaming (bistream) path on the tiny CosyVoice2 checkpoint.

Run with the official environment (``official_env``; FunAudioLLM/CosyVoice at
``ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40``, Matcha-TTS at ``dd9105b34bf2be2230f4aa1e4769fb586a3c824e``)::

    /work/venv/bin/trt-cosy make-test-model --size tiny --seed 0 --out /tmp/extras-v2   # trt-cosy's venv
    /work/official-venv/bin/python tools/golden/make_bistream_golden.py --extras /tmp/extras-v2 \\
        --out tests/data/bistream/cosyvoice2-tiny-bistream.npz

What runs (all official code, torch CPU fp32, 2 threads; nothing here re-implements it):

* the prompt is the golden reference's (``tests/data/cosyvoice2-tiny/reference.npz``: ``in_prompt_text``
  8 ids, ``in_prompt_speech_token`` 25 tokens, ``in_prompt_feat``, ``in_spk_embedding``);
* the text is ``PIECES``, handed to the official frontend as a generator
  (``CosyVoiceFrontEnd._extract_text_token_generator``: each piece tokenised alone, ids one at a time),
  exactly what ``CosyVoice2.inference_zero_shot(tts_text=<generator>)`` passes on;
* ``Qwen2LM.inference_bistream`` with the arguments ``CosyVoice2Model.llm_job`` gives it, (a) greedy:
  the yaml's sampler replaced by argmax (as reference.npz's ``llm_greedy_tokens``), (b) seeded RAS
  sampling: the official ``ras_sampling`` with ``Tensor.multinomial`` drawing by inverse CDF from
  ``numpy.random.default_rng(seed)`` (float64 cumsum of the float32 weights, ``u * total``,
  ``searchsorted(side="right")``), the draws trt-cosy's ``RASSampler`` makes with the same generator
  (torch's own multinomial cannot be reproduced, spec §3.4). The seed is the first of ``SAMPLE_SEEDS``
  whose run ends without the official ``ValueError`` (a special id out of place);
* the official bistream has no length limit and the random model never says eos, so each run is cut
  after ``20 x text ids`` speech tokens (trt-cosy's limit, ``stages.bistream``): the tokens are that
  prefix of the official output;
* audio: ``CosyVoice2Model.tts(text=<generator>, stream=False)`` (LLM thread, then one ``token2wav``),
  greedy, its LLM output cut after ``AUDIO_TOKENS`` tokens; the HiFT sine noise (``torch.randn_like`` of
  the [1, S, 9] sine waves) drawn from ``numpy.random.default_rng(NOISE_SEED).standard_normal`` (the
  draw trt-cosy's vocoder makes from a generator; the NSF source-noise draw is not used by inference).

Stored (int32 / float32; ``meta_json`` has commits, seeds, versions, stand-in hashes):
``piece_ids`` (all ids) and ``piece_lengths``; ``greedy_tokens`` and ``greedy_top_logp`` (the log-prob
of each greedy pick: it shows an input layout error that leaves the argmax unchanged); ``sampled_tokens`` and ``sample_seed``;
``audio_tokens`` and ``audio`` [S].
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official_env as env  # noqa: E402

PIECES = ["Hello there, ", "this is a ", "streamed sentence ", "that arrives ", "a few words ", "at a time."]
SAMPLE_SEEDS = (11, 12, 13, 14, 15, 16, 17, 18)
NOISE_SEED = 7
AUDIO_TOKENS = 60
RATIO = 20  # speech tokens per text id at most (trt-cosy's limit of a streamed request)


def _numpy_multinomial(rng):
    import torch

    def multinomial(self, num_samples, replacement=False, *, generator=None):
        weights = self.detach().cpu().numpy().astype(np.float32)  # [N]
        cdf = np.cumsum(weights, dtype=np.float64)
        index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        if index >= len(weights) or weights[index] <= 0:
            index = int(np.flatnonzero(weights > 0)[-1])
        return torch.tensor([index], dtype=torch.long)

    return multinomial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--extras", type=Path, required=True, help="a make-test-model --size tiny --seed 0 release"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bistream-golden-model"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    model_dir = env.official_model_dir("v2", args.extras, args.work)
    cosy = env.load_official("v2", model_dir)
    model, llm, frontend = cosy.model, cosy.model.llm, cosy.frontend
    ref = np.load(env.GOLDEN_DIRS["v2"] / "reference.npz")
    prompt_text = torch.from_numpy(ref["in_prompt_text"].astype(np.int32))  # [1, 8]
    prompt_speech = torch.from_numpy(ref["in_prompt_speech_token"].astype(np.int32))  # [1, 25]
    prompt_feat = torch.from_numpy(ref["in_prompt_feat"])  # [1, 50, 80]
    embedding = torch.from_numpy(ref["in_spk_embedding"])  # [1, 192]

    piece_ids = [frontend._extract_text_token(piece)[0].reshape(-1).tolist() for piece in PIECES]
    n_ids = sum(len(ids) for ids in piece_ids)

    def bistream(limit: int) -> list[int]:
        """``llm_job``'s call of ``inference_bistream`` on the text generator, cut after ``limit`` tokens."""
        text = frontend._extract_text_token_generator(iter(PIECES))
        tokens = llm.inference_bistream(
            text=text,
            prompt_text=prompt_text,
            prompt_text_len=torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
            prompt_speech_token=prompt_speech,
            prompt_speech_token_len=torch.tensor([prompt_speech.shape[1]], dtype=torch.int32),
            embedding=embedding,
        )
        return [int(t) for t in itertools.islice(tokens, limit)]

    official_sampling = llm.sampling
    top_logp: list[float] = []  # the greedy pick's log-prob at every sampled step (forced fills excluded)

    def greedy_pick(scores, decoded, sampling):
        top_logp.append(float(scores.max()))
        return int(scores.argmax())

    llm.sampling = greedy_pick
    greedy = bistream(RATIO * n_ids)

    real_multinomial = torch.Tensor.multinomial
    llm.sampling = official_sampling
    sampled, sample_seed = None, None
    for seed in SAMPLE_SEEDS:
        torch.Tensor.multinomial = _numpy_multinomial(np.random.default_rng(seed))
        try:
            sampled, sample_seed = bistream(RATIO * n_ids), seed
            break
        except ValueError as exc:  # the official code's answer to a special id out of place
            print(f"seed {seed}: {exc}; next seed")
        finally:
            torch.Tensor.multinomial = real_multinomial
    if sampled is None:
        raise SystemExit("every sampling seed hit the official ValueError")

    # Audio: the official tts() with the generator, greedy, its LLM output cut after AUDIO_TOKENS.
    llm.sampling = lambda scores, decoded, sampling: int(scores.argmax())
    real_bistream = llm.inference_bistream
    audio_tokens: list[int] = []

    def cut_bistream(**kw):
        for token in itertools.islice(real_bistream(**kw), AUDIO_TOKENS):
            audio_tokens.append(int(token))
            yield token

    llm.inference_bistream = cut_bistream
    noise_rng = np.random.default_rng(NOISE_SEED)
    real_randn_like = torch.randn_like

    def randn_like(tensor, *a, **kw):
        if tensor.dim() == 3 and tensor.shape[-1] == 9:  # SineGen2's sine noise [1, S, 9]
            return torch.from_numpy(noise_rng.standard_normal(tuple(tensor.shape), dtype=np.float32))
        return real_randn_like(tensor, *a, **kw)

    torch.randn_like = randn_like
    try:
        outputs = list(
            model.tts(
                text=frontend._extract_text_token_generator(iter(PIECES)),
                flow_embedding=embedding,
                llm_embedding=embedding,
                prompt_text=prompt_text,
                llm_prompt_speech_token=prompt_speech,
                flow_prompt_speech_token=prompt_speech,
                prompt_speech_feat=prompt_feat,
                stream=False,
            )
        )
    finally:
        torch.randn_like = real_randn_like
        llm.inference_bistream = real_bistream
    audio = torch.cat([o["tts_speech"] for o in outputs], dim=1)[0].numpy().astype(np.float32)  # [S]

    meta = {
        "official_commit": env.OFFICIAL_COMMIT,
        "matcha_commit": env.MATCHA_COMMIT,
        "command": " ".join(sys.argv),
        "pieces": PIECES,
        "ratio": RATIO,
        "audio_tokens": AUDIO_TOKENS,
        "noise_seed": NOISE_SEED,
        "sample_seed": sample_seed,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "standins": env.standin_hashes("v2", model_dir),
        "mix_ratio": list(llm.mix_ratio),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        piece_ids=np.asarray(sum(piece_ids, []), np.int32),
        piece_lengths=np.asarray([len(ids) for ids in piece_ids], np.int32),
        greedy_tokens=np.asarray(greedy, np.int32),
        greedy_top_logp=np.asarray(top_logp, np.float32),
        sampled_tokens=np.asarray(sampled, np.int32),
        sample_seed=np.int32(sample_seed),
        audio_tokens=np.asarray(audio_tokens, np.int32),
        audio=audio,
        meta_json=np.asarray(json.dumps(meta)),
    )
    print(
        f"{args.out}: {n_ids} text ids, greedy {len(greedy)}, sampled {len(sampled)} (seed {sample_seed}), audio {audio.size}"
    )


if __name__ == "__main__":
    main()
