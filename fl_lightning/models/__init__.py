"""Model builders returning :class:`FeatureClassifier`, registered by name for recipes."""

from .base import FeatureClassifier
from .digits import digits_cnn, digits_mlp
from .registry import ModelSpec, register_model, registered_models, resolve_builder
from .resnet import resnet20

__all__ = [
    "FeatureClassifier",
    "ModelSpec",
    "digits_cnn",
    "digits_mlp",
    "register_model",
    "registered_models",
    "resnet20",
    "resolve_builder",
]
