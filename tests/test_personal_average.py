"""``evaluation.average: examples``: the personal accuracy over all examples (HtFLlib's correct / samples)."""

import numpy as np
import pytest
from conftest import method_env

from fl_lightning.client.evaluation import Evaluator, PersonalEvaluation
from fl_lightning.data import DigitsData, DirichletPartitioner
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedProto

MODELS = {"mlp": ModelSpec("digits_mlp", {"hidden": 16}), "cnn": ModelSpec("digits_cnn", {"width": 0.25})}
TIERS = [Tier("mlp", ["mlp"], count=3), Tier("cnn", ["cnn"])]


def test_examples_average_weights_each_client_by_its_local_test_examples():
    data = DigitsData(partitioner=DirichletPartitioner(0.3, 20), local_split=(0.75, 0.0, 0.25))
    strategy = FedProto(inference="local_head")
    server = method_env(strategy, MODELS, TIERS, num_clients=6, data=data)
    scores = {}
    for average in ("clients", "examples"):
        evaluator = Evaluator(server._loop, server.data, server.clients, {}, PersonalEvaluation(average=average))
        scores[average] = evaluator.personalized(strategy.personal_weights, split="test")
    per_client = evaluator.per_client  # the same models: each client's accuracy on its local test split
    sizes = {c.id: len(server.data.clients[c.id].test) for c in server.clients}
    assert len(set(sizes.values())) > 1  # clients of different sizes, so the two averages differ
    correct = sum(per_client[i] * sizes[i] for i in sizes)  # accuracies times examples: counts of correct answers
    assert scores["examples"]["personal/test_acc"] == pytest.approx(correct / sum(sizes.values()), abs=1e-12)
    assert scores["clients"]["personal/test_acc"] == pytest.approx(np.mean(list(per_client.values())), abs=1e-12)
    cnn = [c.id for c in server.clients if c.tier == "cnn"]
    assert scores["examples"]["personal/cnn/test_acc"] == pytest.approx(
        sum(per_client[i] * sizes[i] for i in cnn) / sum(sizes[i] for i in cnn), abs=1e-12
    )
    # the spread and the minimum stay over clients
    for name in ("personal/test_acc_std", "personal/test_acc_min"):
        assert scores["examples"][name] == scores["clients"][name]
    # another value is refused by the command's parser (its Literal type): tests/test_bad_inputs.py
