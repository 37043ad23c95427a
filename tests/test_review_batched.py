"""Review of the batched executor's strided batch-norm rows (commit e49956c): a case it gets silently wrong.

``_norm_buffers_for_rows`` puts the running statistics of every ``_BatchNorm`` in evaluation mode into strided
rows, on the grounds that such a norm only reads them. A subclass whose forward updates its statistics in
evaluation mode too (test-time adaptation) is a ``_BatchNorm`` as well: vmap's batch-norm rule writes a strided
running mean into a copy, so the batched fit keeps the teacher's starting statistics while the sequential
loop moves them. Before e49956c the statistics sat in contiguous blocks and the two executors agreed.
"""

import torch
import torch.nn.functional as F
from test_batched_units import _assert_same, _batches, _both, _loop, _request

from fl_lightning.client import batched as B


class _AdaptingNorm(torch.nn.BatchNorm1d):
    """Normalises with the batch's statistics and updates the running ones in either mode."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)


def test_a_batch_norm_that_updates_its_statistics_in_evaluation_mode_matches_the_sequential_loop():
    torch.manual_seed(0)
    modules = {
        "t": torch.nn.Sequential(torch.nn.Linear(3, 4), _AdaptingNorm(4), torch.nn.Linear(4, 2)),
        "s": torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)),
    }
    loop = _loop(modules, lambda p: torch.optim.SGD(p, lr=0.1))
    teacher = modules["t"].eval()

    @B.vmappable
    def kd(module, batch, i):
        x, y = batch
        return F.cross_entropy(module(x), y) + F.mse_loss(module(x), teacher(x).detach())

    requests = [_request(loop, "s", _batches(3), kd, weights={"t": {"1.running_mean": torch.randn(4)}}) for _ in "abc"]
    start = requests[0].slots["t"]["1.running_mean"].clone()
    sequential, executed, _ = _both(loop, requests)
    assert not torch.equal(sequential[0].slots["t"]["1.running_mean"], start)  # the sequential loop moves them
    _assert_same(sequential, executed, atol=1e-5)  # fails at HEAD 58d7c65: the batched fit keeps ``start``
