"""Paper 002's models: 5-layer CNNs for CIFAR-100 and LSTM language models for StackOverflow.

CNN: three 3x3 convs with bias and two hidden dense layers plus the output layer. A 6x6 final map from
32x32 inputs needs a 'valid' conv; no source says which of the possible orders was used, so we take
``same, pool, same, pool, valid`` (32 -> 32 -> 16 -> 16 -> 8 -> 6). The counts match Appendix E exactly:
109,348 (filters 16/32/32, dense 64/128) and 410,084 (32/64/64, dense 128/256) for 100 classes.

LSTM: Embedding(V, E) -> per layer [LSTM(H) -> Dense(E)] -> Dense(V) (google-research/federated
``stackoverflow_models.py``). Keras LSTMs have one bias vector per gate while PyTorch's have two; the
second (``bias_hh``) is kept as a zero buffer, so trainable parameters match Keras: 1,984,348 (E 96,
H 70, one layer) and 4,278,644 (E 192, H 140, two layers) for a 10,004-token vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import FeatureClassifier
from .registry import register_model


def codist_cnn(
    filters: tuple[int, int, int], dense: tuple[int, int], num_classes: int = 100, in_channels: int = 3
) -> FeatureClassifier:
    f1, f2, f3 = filters
    features = nn.Sequential(
        nn.Conv2d(in_channels, f1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 -> 16
        nn.Conv2d(f1, f2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 -> 8
        nn.Conv2d(f2, f3, 3),
        nn.ReLU(),  # 8 -> 6 (valid)
        nn.Flatten(),
        nn.Linear(f3 * 36, dense[0]),
        nn.ReLU(),
        nn.Linear(dense[0], dense[1]),
        nn.ReLU(),
    )
    return FeatureClassifier(features, nn.Linear(dense[1], num_classes), dense[1], num_classes)


@register_model("codist_cnn_small")
def codist_cnn_small(num_classes: int = 100, in_channels: int = 3) -> FeatureClassifier:
    """Paper 002's small CIFAR-100 CNN (109,348 parameters for 100 classes)."""
    return codist_cnn((16, 32, 32), (64, 128), num_classes, in_channels)


@register_model("codist_cnn_large")
def codist_cnn_large(num_classes: int = 100, in_channels: int = 3) -> FeatureClassifier:
    """Paper 002's large CIFAR-100 CNN (410,084 parameters for 100 classes)."""
    return codist_cnn((32, 64, 64), (128, 256), num_classes, in_channels)


class KerasLSTM(nn.LSTM):
    """``nn.LSTM`` with one bias vector per gate (Keras): the hidden-hidden biases are zero buffers."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__(input_size, hidden_size, batch_first=True)
        for name in [n for n in self._flat_weights_names if n.startswith("bias_hh")]:
            value = getattr(self, name).detach()
            delattr(self, name)
            self.register_buffer(name, torch.zeros_like(value))
        self._init_flat_weights()


class SequenceFeatures(nn.Module):
    """Embedding then ``layers`` x [LSTM(hidden) -> Dense(embedding)]: ``[B, T]`` ids -> ``[B, T, E]``."""

    def __init__(self, vocab_size: int, embedding: int, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding)
        self.lstms = nn.ModuleList(KerasLSTM(embedding, hidden) for _ in range(layers))
        self.projections = nn.ModuleList(nn.Linear(hidden, embedding) for _ in range(layers))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for lstm, projection in zip(self.lstms, self.projections):
            x = projection(lstm(x)[0])
        return x


def stackoverflow_lstm(embedding: int, hidden: int, layers: int, vocab_size: int = 10_004) -> FeatureClassifier:
    """Next-word model; ``features`` gives ``[B, T, E]`` and the head ``[B, T, V]`` logits."""
    return FeatureClassifier(
        SequenceFeatures(vocab_size, embedding, hidden, layers), nn.Linear(embedding, vocab_size), embedding, vocab_size
    )


@register_model("stackoverflow_lstm_small")
def stackoverflow_lstm_small(vocab_size: int = 10_004) -> FeatureClassifier:
    """Paper 002's small StackOverflow LSTM (E 96, H 70, one layer: 1,984,348 parameters)."""
    return stackoverflow_lstm(96, 70, 1, vocab_size)


@register_model("stackoverflow_lstm_large")
def stackoverflow_lstm_large(vocab_size: int = 10_004) -> FeatureClassifier:
    """Paper 002's large StackOverflow LSTM (E 192, H 140, two layers: 4,278,644 parameters)."""
    return stackoverflow_lstm(192, 140, 2, vocab_size)
