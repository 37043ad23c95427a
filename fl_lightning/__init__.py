"""fl-lightning: heterogeneous-model federated learning with knowledge distillation."""

__version__ = "0.1.0"
