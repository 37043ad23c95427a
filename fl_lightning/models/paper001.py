"""Paper 001's FEMNIST CNN, Speech Commands CNN and IMDB Bi-LSTM, with width multipliers.

The official code holds only CIFAR-10 (FIDELITY), so these follow the usual models of their benchmarks:
LEAF's FEMNIST CNN, a four-block spectrogram CNN and a one-layer bidirectional LSTM classifier. Widths
scale every layer (25-100% in paper 001's Tables 3 and 6).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import FeatureClassifier, scaled
from .registry import register_model


@register_model("femnist_cnn")
def femnist_cnn(num_classes: int = 62, in_channels: int = 1, width: float = 1.0) -> FeatureClassifier:
    """LEAF's FEMNIST CNN on 28x28: conv5x5(32)-pool-conv5x5(64)-pool-dense(2048), times ``width``."""
    c1, c2, dim = scaled(32, width), scaled(64, width), scaled(2048, width)
    features = nn.Sequential(
        nn.Conv2d(in_channels, c1, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 7 * 7, dim),
        nn.ReLU(),
    )
    return FeatureClassifier(features, nn.Linear(dim, num_classes), dim, num_classes)


@register_model("speech_cnn")
def speech_cnn(num_classes: int = 35, in_channels: int = 1, width: float = 1.0) -> FeatureClassifier:
    """Spectrogram CNN: four [conv3x3-BN-ReLU-maxpool2] blocks (32/64/128/128 x ``width``), global
    average pooling, dense(128 x ``width``). Works for any spectrogram size."""
    channels = [scaled(c, width) for c in (32, 64, 128, 128)]
    layers: list[nn.Module] = []
    previous = in_channels
    for c in channels:
        layers += [nn.Conv2d(previous, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
        previous = c
    dim = scaled(128, width)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, dim), nn.ReLU()]
    return FeatureClassifier(nn.Sequential(*layers), nn.Linear(dim, num_classes), dim, num_classes)


class BiLSTMFeatures(nn.Module):
    """Token ids ``[B, T]`` (0 = padding) -> concatenated last forward / first backward states ``[B, 2H]``."""

    def __init__(self, vocab_size: int, embedding: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding, padding_idx=0)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True, bidirectional=True)

    def forward(self, tokens: Tensor) -> Tensor:
        lengths = (tokens != 0).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.lstm(packed)  # h: [2, B, H]
        return torch.cat([h[0], h[1]], dim=1)


@register_model("imdb_bilstm")
def imdb_bilstm(
    num_classes: int = 2, vocab_size: int = 20_000, embedding: int = 128, hidden: int = 128, width: float = 1.0
) -> FeatureClassifier:
    """Bidirectional LSTM sentiment classifier; ``width`` scales embedding and hidden sizes (25% / 100%)."""
    e, h = scaled(embedding, width), scaled(hidden, width)
    return FeatureClassifier(BiLSTMFeatures(vocab_size, e, h), nn.Linear(2 * h, num_classes), 2 * h, num_classes)
