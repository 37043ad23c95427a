"""Standalone: each client trains only its own model, which persists between rounds; nothing is sent either way;
and a run that resumes exactly (the personal models are checkpointed)."""

import torch
from conftest import check_resume, client_update, method_env, phase_tasks, read_summary, write_recipe

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import Standalone

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)


def test_standalone_client_continues_its_own_model_with_nothing_sent():
    """One SGD step at lr 1 on the constant model's cross-entropy moves only its head bias b, by
    softmax(b) - (the client's class frequencies); a second round starts from the kept model."""
    sgd = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), local_steps=1, batch_size=10_000)
    strategy = Standalone()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=sgd)
    client, state = server.clients[0], {}
    y = server.data.y[server.data.clients[0].train]
    frequencies = torch.bincount(y, minlength=10).float() / len(y)
    bias = torch.arange(10.0)
    for rnd in (1, 2):
        task = phase_tasks(strategy, rnd, [client])[0]
        assert task.downlink == {}
        update = client_update(strategy, server, task, state)
        assert update.uplink == {}
        bias = bias - (torch.softmax(bias, 0) - frequencies)
        assert torch.allclose(state["weights"]["head.bias"], bias, atol=1e-6)
    assert not torch.equal(state["weights"]["head.bias"], torch.arange(10.0))


def test_standalone_sends_nothing_and_resumes_exactly(tmp_path):
    """Four rounds stopped after round 2 and resumed equal the uninterrupted run; the ledger stays at zero."""
    recipe = write_recipe(tmp_path / "standalone.yaml", strategy={"class_path": "fl_lightning.strategies.Standalone"})
    full = check_resume(tmp_path, recipe, stop_after=2)
    comm = read_summary(full)["comm"]
    assert comm["uplink_bytes"] == comm["downlink_bytes"] == 0
    assert read_summary(full)["final"]["personal/test_acc"] > 0.2  # the clients did learn their own models
