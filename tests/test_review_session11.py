"""Review of session 11's commits: failing tests for what the review found (see the report for each).

1. Two ranks compare fingerprints of their server states (fe6ed7d). FedAdam's server optimizer keeps its
   moments in a dict filled by iterating ``parameter_names`` (a set of strings), whose order differs between
   processes (string hashing is randomized per process), so the two ranks hold the same tensors in another
   key order, the fingerprint (walked in insertion order) differs, and every FedAdam / codistillation run
   with ``--runtime.devices 2`` stops in round 2.
2. The batched executor's fallback after running out of memory (or after a step that cannot run batched)
   gives each client its first batch back but puts its global generator back to the state before that
   batch was drawn: a batch stream that draws from the global generator (which ``_next_batch`` supports)
   then draws its second batch from the first one's state, and the numbers differ from the sequential loop.
3. Out of memory after the first step while gathering the batch (named in the code's comment) stops the
   run with torch's bare error, not the message naming runtime.batch_clients that the commit promises.
"""

import torch
from conftest import ROOT, run_cli
from test_batched_units import _assert_same, _loop, _request

from fl_lightning.client import batched as B
from fl_lightning.client.loop import batch_stream


# ---------------------------------------------------------------------- 1. server fingerprints across ranks
def test_two_ranks_of_fedadam_do_not_stop_on_a_spurious_server_state_difference(tmp_path, monkeypatch):
    """Each rank's interpreter hashes strings with its own seed (unless PYTHONHASHSEED is set), as in a real launch."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    argv = ["fit", "--config", str(ROOT / "recipes/digits_fedadam.yaml"), "--rounds", "2"]
    argv += ["--eval_every", "2", "--output_dir", str(tmp_path / "two"), "--runtime.devices", "2"]
    assert run_cli(*argv) == 0  # was: "round 2: the server state of rank(s) [1] differs from rank 0's"


# ---------------------------------------------------------------------- 2. the generator after a fallback
def _noisy_stream(steps: int = 3):
    """Batches drawn from torch's global generator (a ctx.fit(batches=...) stream may do so)."""
    for _ in range(steps):
        yield torch.randn(4, 3), torch.randint(0, 2, (4,))


def _requests(loop) -> list[B.FitRequest]:
    made = []
    for k in range(2):
        torch.manual_seed(k)  # each client its own generator state
        request = _request(loop, "r", None)
        request.batches = _noisy_stream()
        made.append(request)
    return made


def test_a_group_that_falls_back_after_running_out_of_memory_draws_the_sequential_batches(monkeypatch):
    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    sequential, batched, halved = _requests(loop), _requests(loop), _requests(loop)  # all from the same start
    fit = B.BatchedFit(loop)
    for request in sequential:
        fit._sequential(request)
    B.BatchedFit(loop).run(batched)
    _assert_same(sequential, batched, atol=1e-5)  # batched, each client's batches under its own generator: equal
    real = B._GroupTraining._gradients

    def gradients(self, params, *args, **kwargs):
        if len(next(iter(params.values()))) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, params, *args, **kwargs)

    monkeypatch.setattr(B._GroupTraining, "_gradients", gradients)
    fit = B.BatchedFit(loop)
    fit.run(halved)
    assert fit.counts == {"batched_fits": 0, "sequential_fits": 2}  # [2] ran out -> [1], [1]
    for s, h in zip(sequential, halved):
        assert torch.equal(h.rng_state[0], s.rng_state[0])  # was: one draw behind
    _assert_same(sequential, halved, atol=1e-5)  # was: the second and third batches differed


# ---------------------------------------------------------------------- 3. out of memory in a later gather
def test_running_out_of_memory_while_gathering_a_later_batch_names_what_to_change(monkeypatch):
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(24, 3), torch.randint(0, 2, (24,))
    requests = []
    for k in range(2):
        request = _request(loop, "r", None)
        request.batches = batch_stream(x, y, torch.arange(k * 12, k * 12 + 12), 4, 3, torch.Generator().manual_seed(k))
        requests.append(request)
    real, calls = B._gather, []

    def gather(stream, parts):
        calls.append(len(parts))
        if len(calls) == 2:  # step 1's gather of both clients
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(stream, parts)

    monkeypatch.setattr(B, "_gather", gather)
    try:
        B.BatchedFit(loop).run(requests)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    assert "runtime.batch_clients" in message, message  # was: torch's bare "CUDA out of memory (simulated)"
