"""Google Speech Commands v0.02: 35 words, 1 s clips, partitioned by speaker; spectrograms by torch.stft."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .federated import DataArrays, FederatedData
from .partition import NaturalIdPartitioner

SAMPLE_RATE = 16_000


def spectrogram(wave: torch.Tensor, n_fft: int = 128, hop_length: int = 128) -> torch.Tensor:
    """Paper 001 Appendix 6.2: zero-pad or trim to 1 s, STFT magnitude; ``log1p`` compresses the range.

    ``[N, samples]`` -> ``[N, 1, n_fft // 2 + 1, frames]``.
    """
    wave = torch.nn.functional.pad(wave, (0, max(0, SAMPLE_RATE - wave.shape[1])))[:, :SAMPLE_RATE]
    spec = torch.stft(wave, n_fft=n_fft, hop_length=hop_length, window=torch.hann_window(n_fft), return_complex=True)
    return torch.log1p(spec.abs()).unsqueeze(1)


class SpeechCommandsData(FederatedData):
    """Speech Commands v0.02 from ``<data_dir>/speech_commands_v0.02/<word>/<speaker>_nohash_<k>.wav``.

    The official ``testing_list.txt`` clips form the global test set, the others (validation included)
    the pool; each speaker is one natural client. wav files are decoded with soundfile.

    Args:
        n_fft, hop_length: STFT settings (65 x 126 spectrograms by default).
        download: fetch the archive over https, check its SHA-256 (TensorFlow Datasets' / torchaudio's) and
            unpack it, as ``flrun data fetch speech_commands``.
    """

    default_partitioner = NaturalIdPartitioner

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        n_fft: int = 128,
        hop_length: int = 128,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data_dir, self.download = Path(data_dir), download
        self.n_fft, self.hop_length = n_fft, hop_length

    def load(self) -> DataArrays:
        import soundfile

        root = self.data_dir / "speech_commands_v0.02"
        listing = root / "testing_list.txt"
        if not listing.is_file():
            sources.ensure("speech_commands", self.data_dir, self.download)
        with sources.reading(listing, "a text file of test clips", "speech_commands", self.data_dir):
            test_set = set(listing.read_text().split())
        words = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_"))
        waves, labels, speakers, is_test = [], [], [], []
        for label, word in enumerate(words):
            for wav in sorted((root / word).glob("*.wav")):
                with sources.reading(wav, "a WAV file", "speech_commands", self.data_dir):
                    audio, rate = soundfile.read(wav, dtype="float32")
                    if not np.isfinite(audio).all():  # a float WAV may hold NaN: its spectrogram would be NaN
                        at = int(np.argmax(~np.isfinite(audio).reshape(-1)))
                        raise ValueError(f"sample {at} holds {audio.reshape(-1)[at]}, not a finite number")
                if audio.ndim != 1:
                    raise ConfigError(f"{wav} has {audio.shape[1]} channels, expected one (mono).")
                if rate != SAMPLE_RATE:
                    raise ConfigError(f"{wav} has sample rate {rate}, expected {SAMPLE_RATE}.")
                waves.append(np.pad(audio, (0, max(0, SAMPLE_RATE - len(audio))))[:SAMPLE_RATE])
                labels.append(label)
                speakers.append(wav.name.split("_nohash_")[0])
                is_test.append(f"{word}/{wav.name}" in test_set)
        if not waves:
            raise sources.missing("speech_commands", self.data_dir)  # a test list without a word folder of clips
        x = spectrogram(torch.from_numpy(np.stack(waves)), self.n_fft, self.hop_length)
        y, test = torch.tensor(labels), np.asarray(is_test)
        self.words = words
        return DataArrays(
            x[~test], y[~test], x[test], y[test], groups=np.asarray(speakers)[~test], num_classes=len(words)
        )
