"""The batched executor's group training against the sequential loop, on hand-built loops and requests.

Cases a recipe does not reach: a module two roles share, optimizer step counts that differ between
parameters, a parameter the step does not use, records of a first step that fails in its second shape
group, Adam on rows of two dtypes, per-parameter step counts after a fit, batches gathered at once, batch
norms whose statistics sit in rows (and the steps and subclasses that must keep them out), batches
that are not all tensors, and lockstep (``runtime.lockstep``): clients that finish early, records of padded
batches, and steps or batch norms that cannot leave padded rows out.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.client import vmappable
from fl_lightning.client.batched import fit_request, group_training, placement, stacked_optim
from fl_lightning.client.batched import fits as B
from fl_lightning.client.batches import batch_stream
from fl_lightning.client.loop import LocalLoop
from fl_lightning.client.steps import ModelSlot
from fl_lightning.client.training import LocalTraining
from fl_lightning.distributed.fabric import fabric_class
from fl_lightning.federation.padding import class_index, padded_loss


@vmappable
def _cross_entropy(module, batch, i):
    x, y = batch
    return F.cross_entropy(module(x), y)


def _loop(modules: dict, optimizer) -> LocalLoop:
    loop = LocalLoop(fabric_class()(accelerator="cpu", devices=1), LocalTraining(), rounds=1)
    for role, module in modules.items():
        opt = optimizer(module.parameters())
        loop.slots[role] = ModelSlot(module, opt, [g["lr"] for g in opt.param_groups])
    return loop


def _request(
    loop, role, batches, step=_cross_entropy, weights=None, state=None, on_record=None
) -> fit_request.FitRequest:
    if weights:  # this client's own starting weights, put into the shared instances before the snapshot
        with torch.no_grad():
            for r, named in weights.items():
                live = dict([*loop.slots[r].module.named_parameters(), *loop.slots[r].module.named_buffers()])
                for n, v in named.items():
                    live[n].copy_(v)
    return fit_request.FitRequest(
        role=role,
        batches=batches,
        step_fn=step,
        on_record=on_record,
        rnd=0,
        slots=fit_request.snapshot_slots(loop),
        modes=fit_request.training_modes(loop),
        optimizer_state=copy.deepcopy(state) if state is not None else fit_request.snapshot_optimizer(loop.slots[role]),
        rng_state=fit_request.random_state(),
    )


def _copy(request: fit_request.FitRequest) -> fit_request.FitRequest:
    twin = copy.copy(request)
    twin.slots, twin.optimizer_state = copy.deepcopy(request.slots), copy.deepcopy(request.optimizer_state)
    twin.batches = list(request.batches)
    return twin


def _both(loop, requests):
    """(the sequential fits, the executor's fits, its counts) of copies of ``requests``."""
    sequential, executed = [_copy(r) for r in requests], [_copy(r) for r in requests]
    fit = B.BatchedFit(loop)
    for request in sequential:
        fit._sequential(request)
    fit.counts = {"batched_fits": 0, "sequential_fits": 0}
    fit.run(executed)
    return sequential, executed, fit.counts


def _assert_same(sequential, executed, atol=1e-6):
    for s, b in zip(sequential, executed):
        for role in s.slots:
            for name, value in s.slots[role].items():
                torch.testing.assert_close(b.slots[role][name], value, rtol=0, atol=atol, msg=f"{role}.{name}")


def _batches(n, size=4):
    return [(torch.randn(size, 3), torch.randint(0, 2, (size,))) for _ in range(n)]


def test_a_module_two_roles_share_trains_as_in_the_sequential_loop():
    for trained in ("a", "b"):  # the trained role first or second: its tensors must reach the shared module
        torch.manual_seed(0)
        shared = torch.nn.Linear(3, 5)
        modules = {r: torch.nn.Sequential(shared, torch.nn.ReLU(), torch.nn.Linear(5, 2)) for r in ("a", "b")}
        loop = _loop(modules, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        requests = [
            _request(loop, trained, _batches(2), weights={"a": {"0.weight": torch.randn(5, 3)}}) for _ in range(3)
        ]
        sequential, executed, counts = _both(loop, requests)
        assert counts["batched_fits"] == 3
        _assert_same(sequential, executed)


def test_tied_weights_in_the_trained_role_train_as_in_the_sequential_loop():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
            self.b.weight = self.a.weight  # one Parameter under two names

        def forward(self, x):
            return self.head(self.b(torch.relu(self.a(x))))

    torch.manual_seed(0)
    loop = _loop({"r": Tied()}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    sequential, executed, counts = _both(loop, [_request(loop, "r", _batches(2)) for _ in range(2)])
    assert counts["batched_fits"] == 2
    _assert_same(sequential, executed)


def test_uneven_step_counts_and_an_unused_parameter_run_sequentially():
    """torch skips a parameter without a gradient (no step, no decay): whole-row updates cannot, so refuse."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    loop = _loop({"r": model}, lambda p: torch.optim.Adam(p, lr=0.01))
    state = {
        n: {
            "step": torch.tensor(2.0 if j < 2 else 5.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
        for j, (n, p) in enumerate(model.named_parameters())
    }
    sequential, executed, counts = _both(loop, [_request(loop, "r", _batches(2), state=state) for _ in range(2)])
    assert counts == {"batched_fits": 0, "sequential_fits": 2}
    _assert_same(sequential, executed, atol=0)
    assert executed[0].optimizer_state["2.bias"]["step"] == 7 and executed[0].optimizer_state["0.bias"]["step"] == 4

    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.body(x)  # spare has no gradient

    loop = _loop({"r": WithSpare()}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1))
    sequential, executed, counts = _both(loop, [_request(loop, "r", _batches(n)) for n in (1, 3)])
    assert counts == {"batched_fits": 0, "sequential_fits": 2}
    _assert_same(sequential, executed, atol=0)
    # plain SGD: a zero gradient moves nothing, as torch's skipping would, so the group may run batched
    loop = _loop({"r": WithSpare()}, lambda p: torch.optim.SGD(p, lr=0.1))
    sequential, executed, counts = _both(loop, [_request(loop, "r", _batches(n)) for n in (1, 3)])
    assert counts == {"batched_fits": 2, "sequential_fits": 0}
    _assert_same(sequential, executed)


def test_a_first_step_failing_in_its_second_shape_group_records_nothing_twice():
    @vmappable
    def step(module, batch, i):
        x, y = batch
        logits = module(x)
        if x.shape[0] == 3:
            float(logits.detach().sum())  # a host read: fails under vmap, for this shape group only
        return F.cross_entropy(logits, y), (logits,)

    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    records = {k: [] for k in range(3)}
    requests = [
        _request(loop, "r", _batches(2, size), step, on_record=lambda r, k=k: records[k].append(r))
        for k, size in enumerate([4, 3, 4])
    ]
    fit = B.BatchedFit(loop)
    fit.run(requests)
    assert fit.counts == {"batched_fits": 0, "sequential_fits": 3}
    assert [len(records[k]) for k in range(3)] == [2, 2, 2]  # one record per step, none repeated


def test_adam_on_rows_of_two_dtypes_takes_each_dtypes_own_bias_correction():
    options = {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-8, "betas": (0.9, 0.999), "decoupled_weight_decay": False}
    kinds = [(torch.bfloat16, "cpu"), (torch.float32, "cpu")]
    params = {k: torch.ones(2, 6, dtype=k[0]) for k in kinds}
    grads = {k: torch.full((2, 6), 0.5, dtype=k[0]) for k in kinds}
    state = {
        k: {"step": torch.zeros(2), "exp_avg": torch.zeros_like(params[k]), "exp_avg_sq": torch.zeros_like(params[k])}
        for k in kinds
    }
    stacked_optim.adam(params, grads, state, options)
    reference = torch.nn.Parameter(torch.ones(6))
    optimizer = torch.optim.Adam([reference], lr=0.01)
    reference.grad = torch.full((6,), 0.5)
    optimizer.step()
    assert torch.equal(params[kinds[1]][0], reference.detach())


def test_each_parameter_gets_its_own_step_count_and_batches_are_gathered_at_once(monkeypatch):
    gathered = []
    real_gather = group_training.gather
    monkeypatch.setattr(
        group_training, "gather", lambda stream, parts: gathered.append(len(parts)) or real_gather(stream, parts)
    )
    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.Adam(p, lr=0.01))
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    requests = []
    for k in range(2):
        request = _request(loop, "r", [])
        request.batches = batch_stream(x, y, torch.arange(k * 20, k * 20 + 20), 4, 3, torch.Generator().manual_seed(k))
        requests.append(request)
    fit = B.BatchedFit(loop)
    fit.run(requests)
    assert fit.counts["batched_fits"] == 2 and gathered == [2, 2, 2]  # every step: both clients in one gather
    steps = [values["step"] for values in requests[0].optimizer_state.values()]
    assert [float(s) for s in steps] == [3.0, 3.0]
    assert steps[0].untyped_storage().data_ptr() != steps[1].untyped_storage().data_ptr()


def _norm_roles():
    torch.manual_seed(0)
    modules = {
        r: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)) for r in "ts"
    }
    loop = _loop(modules, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    modules["t"].eval()  # a teacher: its batch norm reads each client's own running statistics
    return loop, modules["t"]


def _requests_with_own_teachers(loop, step):
    return [
        _request(
            loop,
            "s",
            _batches(3),
            step,
            weights={"t": {"1.running_mean": torch.randn(4), "1.running_var": torch.rand(4) + 0.5}},
        )
        for _ in range(3)
    ]


def test_a_teachers_batch_norm_statistics_sit_in_rows_and_train_as_in_the_sequential_loop():
    """The statistics of a batch norm in evaluation mode and every num_batches_tracked are stored in rows
    (fewer vmap inputs); the trained role's running statistics, updated by batch norm's rule, in blocks."""
    loop, teacher = _norm_roles()

    @vmappable
    def kd(module, batch, i):
        x, y = batch
        return F.cross_entropy(module(x), y) + F.mse_loss(module(x), teacher(x).detach())

    requests = _requests_with_own_teachers(loop, kd)
    in_rows, eval_norms = placement.norm_buffers_for_rows(loop, "s", requests[0].modes)
    assert in_rows == {
        ("slot", "t", "1.running_mean"),
        ("slot", "t", "1.running_var"),
        ("slot", "t", "1.num_batches_tracked"),
        ("slot", "s", "1.num_batches_tracked"),
    }
    assert eval_norms == [teacher[1]]
    sequential, executed, counts = _both(loop, requests)
    assert counts["batched_fits"] == 3
    _assert_same(sequential, executed)
    for s in executed:
        assert s.slots["s"]["1.num_batches_tracked"] == 6  # two forwards a step, three steps
        assert not torch.equal(s.slots["s"]["1.running_mean"], torch.zeros(4))  # the student's updates arrived


def test_a_step_that_puts_a_teachers_batch_norm_into_training_mode_runs_sequentially():
    loop, teacher = _norm_roles()

    @vmappable  # wrongly: it changes a module's mode
    def kd(module, batch, i):
        x, y = batch
        teacher.train()
        return F.cross_entropy(module(x), y) + F.mse_loss(module(x), teacher(x).detach())

    sequential, executed, counts = _both(loop, _requests_with_own_teachers(loop, kd))
    assert counts == {"batched_fits": 0, "sequential_fits": 3}
    _assert_same(sequential, executed, atol=0)
    assert not torch.equal(executed[0].slots["t"]["1.running_mean"], sequential[1].slots["t"]["1.running_mean"])


def test_a_batch_norm_the_trained_role_shares_with_an_evaluated_role_counts_as_training():
    torch.manual_seed(0)
    shared = torch.nn.BatchNorm1d(4)
    modules = {r: torch.nn.Sequential(torch.nn.Linear(3, 4), shared, torch.nn.Linear(4, 2)) for r in "ts"}
    loop = _loop(modules, lambda p: torch.optim.SGD(p, lr=0.1))
    modes = ((True, True, False, True), (True, True, True, True))  # "t" holds the shared norm in evaluation mode
    in_rows, eval_norms = placement.norm_buffers_for_rows(loop, "s", modes)
    assert eval_norms == [] and ("slot", "t", "1.running_mean") not in in_rows


def test_batches_holding_other_than_tensors_run_sequentially():
    """A step may take batches a strategy built itself (``ctx.fit(batches=...)``): ones holding a non-tensor cannot
    be stacked, so the group runs through the sequential loop with the same numbers."""

    @vmappable
    def step(module, batch, i):
        x, y, scale = batch
        return scale * F.cross_entropy(module(x), y)

    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    requests = [_request(loop, "r", [(*b, 0.5) for b in _batches(2)], step) for _ in range(2)]
    sequential, executed, counts = _both(loop, requests)
    assert counts == {"batched_fits": 0, "sequential_fits": 2}
    _assert_same(sequential, executed, atol=0)


def test_a_step_that_switches_a_batch_norm_to_training_mode_later_stops_with_a_clear_error():
    loop, teacher = _norm_roles()

    @vmappable  # wrongly: from its second step on it changes a module's mode
    def kd(module, batch, i):
        x, y = batch
        teacher.train(i > 0)
        return F.cross_entropy(module(x), y) + F.mse_loss(module(x), teacher(x).detach())

    with pytest.raises(RuntimeError, match="switches a batch norm of another role into training mode after its first"):
        B.BatchedFit(loop).run(_requests_with_own_teachers(loop, kd))


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

    @vmappable
    def kd(module, batch, i):
        x, y = batch
        return F.cross_entropy(module(x), y) + F.mse_loss(module(x), teacher(x).detach())

    requests = [_request(loop, "s", _batches(3), kd, weights={"t": {"1.running_mean": torch.randn(4)}}) for _ in "abc"]
    start = requests[0].slots["t"]["1.running_mean"].clone()
    sequential, executed, _ = _both(loop, requests)
    assert not torch.equal(sequential[0].slots["t"]["1.running_mean"], start)  # the sequential loop moves them
    _assert_same(sequential, executed, atol=1e-5)  # with its statistics in strided rows the batched fit kept `start`


def _out_of_memory_beyond(monkeypatch, where: str, most: int):
    """Makes the group's set-up (``init``) or its vmapped gradients (``step``) run out of memory beyond ``most``
    clients, as a GPU would; returns the sizes of the groups that were tried."""
    tried = []
    if where == "init":
        real = group_training.GroupTraining.__init__

        def init(self, loop, group, *lockstep):
            tried.append(len(group))
            if len(group) > most:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            real(self, loop, group, *lockstep)

        monkeypatch.setattr(group_training.GroupTraining, "__init__", init)
    else:
        real = group_training.GroupTraining._gradients

        def gradients(self, params, *args, **kwargs):
            clients = len(next(iter(params.values())))
            tried.append(clients)
            if clients > most:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(self, params, *args, **kwargs)

        monkeypatch.setattr(group_training.GroupTraining, "_gradients", gradients)
    return tried


@pytest.mark.parametrize("where", ["init", "step"])
@pytest.mark.parametrize("gathered", [False, True])
def test_a_group_the_device_cannot_hold_is_halved_until_it_fits_with_the_same_numbers(monkeypatch, where, gathered):
    """Out of memory while stacking the group or in its first step: nothing has changed, so the group runs
    again in halves (each client's first batch given back), and the role remembers the size that fitted."""
    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    x, y = torch.randn(60, 3), torch.randint(0, 2, (60,))

    def requests():
        made = []
        for k in range(5):
            request = _request(loop, "r", [])
            generator = torch.Generator().manual_seed(k)
            stream = batch_stream(x, y, torch.arange(k * 12, k * 12 + 12), 4, 3, generator)
            request.batches = stream if gathered else list(stream)
            made.append(request)
        return made

    sequential, executed, again = [_copy(r) for r in requests()], requests(), requests()  # all from the same start
    fit = B.BatchedFit(loop)
    for request in sequential:
        fit._sequential(request)
    tried = _out_of_memory_beyond(monkeypatch, where, most=2)
    fit = B.BatchedFit(loop)
    fit.run(executed)
    assert fit.counts == {"batched_fits": 4, "sequential_fits": 1}  # [5] -> [3] -> [2, 1], then [2]
    assert fit.memory_limit == {"r": 2}
    _assert_same(sequential, executed)
    if gathered:  # each client got its stream back, first batch unconsumed: the halves still gathered at once
        assert all(type(r.batches).__name__ == "BatchStream" for r in executed)
    tried.clear()
    fit.run(again)  # the next phase starts from the size that fitted
    assert max(tried) == 2


def test_running_out_of_memory_after_the_first_step_stops_with_what_to_change(monkeypatch):
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    real = group_training.GroupTraining._gradients

    def gradients(self, *args, **kwargs):
        if self.step_index == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(group_training.GroupTraining, "_gradients", gradients)
    with pytest.raises(RuntimeError, match="ran out of memory in step 1 of 2 clients batched.*runtime.batch_clients"):
        B.BatchedFit(loop).run([_request(loop, "r", _batches(2)) for _ in range(2)])


def _noisy_stream(steps: int = 3):
    """Batches drawn from torch's global generator (a ctx.fit(batches=...) stream may do so)."""
    for _ in range(steps):
        yield torch.randn(4, 3), torch.randint(0, 2, (4,))


def _requests(loop) -> list[fit_request.FitRequest]:
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
    real = group_training.GroupTraining._gradients

    def gradients(self, params, *args, **kwargs):
        if len(next(iter(params.values()))) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, params, *args, **kwargs)

    monkeypatch.setattr(group_training.GroupTraining, "_gradients", gradients)
    fit = B.BatchedFit(loop)
    fit.run(halved)
    assert fit.counts == {"batched_fits": 0, "sequential_fits": 2}  # [2] ran out -> [1], [1]
    for s, h in zip(sequential, halved):
        assert torch.equal(h.rng_state[0], s.rng_state[0])  # was: one draw behind
    _assert_same(sequential, halved, atol=1e-5)  # was: the second and third batches differed


def test_running_out_of_memory_while_gathering_a_later_batch_names_what_to_change(monkeypatch):
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(24, 3), torch.randint(0, 2, (24,))
    requests = []
    for k in range(2):
        request = _request(loop, "r", None)
        request.batches = batch_stream(x, y, torch.arange(k * 12, k * 12 + 12), 4, 3, torch.Generator().manual_seed(k))
        requests.append(request)
    real, calls = group_training.gather, []

    def gather(stream, parts):
        calls.append(len(parts))
        if len(calls) == 2:  # step 1's gather of both clients
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(stream, parts)

    monkeypatch.setattr(group_training, "gather", gather)
    try:
        B.BatchedFit(loop).run(requests)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    assert "runtime.batch_clients" in message, message  # was: torch's bare "CUDA out of memory (simulated)"


def test_a_batch_given_back_to_a_stream_comes_first_again_and_then_the_rest_as_before():
    x, y = torch.arange(40.0).view(20, 2), torch.arange(20)

    def stream():
        return batch_stream(x, y, torch.arange(20), 6, 5, torch.Generator().manual_seed(0))

    expected = [b[1].tolist() for b in stream()]
    given = stream()
    first = given.next_parts()
    given.give_back(first)
    assert [b[1].tolist() for b in given] == expected  # iterated
    given = stream()
    assert next(given)[1].tolist() == expected[0]
    given.give_back(given.next_parts())  # the second batch, given back while next()'s generator is running
    assert [next(given)[1].tolist() for _ in range(4)] == expected[1:]


# ---------------------------------------------------------------------------------------------- lockstep
def _lockstep(loop, make_requests):
    """(the sequential fits, the lockstep fits, the lockstep BatchedFit) of fresh requests from ``make_requests``."""
    sequential, executed = make_requests(), make_requests()
    fit = B.BatchedFit(loop)
    for request in sequential:
        fit._sequential(request)
    fit = B.BatchedFit(loop, lockstep=True)
    fit.run(executed)
    return sequential, executed, fit


def _streams(loop, sizes, step=_cross_entropy, records=None):
    """Requests of clients with ``sizes`` examples, one pass in batches of 4 each from its own stream."""
    torch.manual_seed(1)
    x, y = torch.randn(sum(sizes), 3), torch.randint(0, 2, (sum(sizes),))
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    made = []
    for k, (start, n) in enumerate(zip(starts, sizes)):
        on_record = None if records is None else (lambda r, k=k: records[k].append(r))
        request = _request(loop, "r", [], step, on_record=on_record)
        generator = torch.Generator().manual_seed(k)
        request.batches = batch_stream(x, y, torch.arange(start, start + n), 4, -(-n // 4), generator)
        made.append(request)
    return made


def test_lockstep_steps_every_client_in_one_call_and_leaves_finished_clients_alone(monkeypatch):
    """Clients of 10, 3 and 14 examples take 3, 1 and 4 steps of 4 (their last batches of 2, 3 and 2): every step
    is one call of all three, padded where a batch is short, and a client that has finished is put back after
    each call. Adam with weight decay moves every tensor at every step it takes (a finished client moved by a
    step it did not take would differ), counts each client's own steps, and batch norm's running statistics
    come from the real rows alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    loop = _loop({"r": model}, lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1))
    calls, real_step = [], group_training.GroupTraining._step

    def step(self, members, batch, index, padded=None):
        calls.append((len(members), padded is not None and padded.mask is not None))
        return real_step(self, members, batch, index, padded)

    monkeypatch.setattr(group_training.GroupTraining, "_step", step)
    sequential, executed, fit = _lockstep(loop, lambda: _streams(loop, [10, 3, 14]))
    assert fit.counts == {"batched_fits": 3, "sequential_fits": 0}
    assert calls == [(3, True), (3, False), (3, True), (3, True)]  # step 1: no short batch, the 3-client's done
    assert fit.lockstep.summary() == {
        "steps": 4,
        "by_shape_steps": 0,
        "client_steps": 3 + 2 + 2 + 1,
        "padded_client_steps": 3,  # the batches of 3, 2 and 2
        "idle_client_steps": 0 + 1 + 1 + 2,
    }
    _assert_same(sequential, executed, atol=1e-5)
    for s, b, steps in zip(sequential, executed, [3, 1, 4]):
        assert b.result["steps"] == steps and b.result["loss"] == pytest.approx(s.result["loss"], rel=1e-5)
        assert all(values["step"] == steps for values in b.optimizer_state.values())
        for name, values in s.optimizer_state.items():
            torch.testing.assert_close(
                b.optimizer_state[name]["exp_avg_sq"], values["exp_avg_sq"], rtol=1e-4, atol=1e-7
            )


def test_lockstep_hands_each_client_the_records_of_its_own_rows():
    """A step's record (labels and logits per example) reaches each client's collector cut to its real rows: the
    records the sequential loop hands out, no padded row and no step of a finished client among them."""

    @vmappable
    def recording(module, batch, i):
        x, y = batch
        z = module(x)
        return F.cross_entropy(z, y), (y, z)

    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    sequential_records, lockstep_records = {k: [] for k in range(3)}, {k: [] for k in range(3)}
    sequential = _streams(loop, [9, 3, 14], recording, sequential_records)
    lockstep = _streams(loop, [9, 3, 14], recording, lockstep_records)  # from the same weights
    fit = B.BatchedFit(loop)
    for request in sequential:
        fit._sequential(request)
    fit = B.BatchedFit(loop, lockstep=True)
    fit.run(lockstep)
    assert fit.lockstep.counts["padded_client_steps"] == 3
    for k in range(3):
        assert [len(y) for y, _ in lockstep_records[k]] == [len(y) for y, _ in sequential_records[k]]
        for (y, z), (y_seq, z_seq) in zip(lockstep_records[k], sequential_records[k]):
            assert torch.equal(y, y_seq)
            torch.testing.assert_close(z, z_seq)


def _table_step(honours: bool):
    table = torch.tensor([[1.0, -1.0], [-2.0, 2.0]])

    @vmappable
    def step(module, batch, i):
        x, y = batch
        if honours:  # a padded row's PAD label points at class 0, and the mean leaves the row out
            return padded_loss(F.mse_loss, module(x), table[class_index(y)])
        return F.mse_loss(module(x), table[y])  # indexes with PAD, and counts padded rows in the mean

    return step


@vmappable
def _plain_mean(module, batch, i):
    x, t = batch
    return F.mse_loss(module(x), t)  # a mean over every row of the batch: padded rows would count


@vmappable
def _masked_mean(module, batch, i):
    x, t = batch
    return padded_loss(F.mse_loss, module(x), t)


def _targets_requests(loop, step):
    """Batches a strategy made itself (no labels to mark PAD): all of 4 rows in step 0, short ones after."""
    torch.manual_seed(2)
    shapes = [[4, 2, 4], [4, 4, 3], [4, 1]]
    return [_request(loop, "r", [(torch.randn(n, 3), torch.randn(n, 2)) for n in sizes], step) for sizes in shapes]


@pytest.mark.parametrize(
    "requests, honours, why",
    [
        (lambda loop: _streams(loop, [9, 3, 14], _table_step(True)), True, None),
        (lambda loop: _streams(loop, [9, 3, 14], _table_step(False)), False, "its step fails on a padded batch"),
        (lambda loop: _targets_requests(loop, _masked_mean), True, None),
        (lambda loop: _targets_requests(loop, _plain_mean), False, "its loss depends on the values of padded rows"),
    ],
)
def test_a_step_that_does_not_honour_the_mask_steps_by_shape_with_the_same_numbers(requests, honours, why):
    """A step's loss on a client's real rows must equal its losses on two paddings of them, checked at the first
    padded step: a step that fails on a PAD label or counts padded rows in its mean steps by batch shape from
    there on (for the rest of the run), with the sequential numbers, and summary.json says why."""
    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    sequential, executed, fit = _lockstep(loop, lambda: requests(loop))
    assert fit.counts == {"batched_fits": 3, "sequential_fits": 0}
    _assert_same(sequential, executed, atol=1e-5)
    summary = fit.lockstep.summary()
    if honours:
        assert summary["by_shape_steps"] == 0 and summary["padded_client_steps"] > 0 and "refused" not in summary
    else:
        assert summary["by_shape_steps"] > 0 and len(summary["refused"]) == 1, summary
        assert summary["refused"][0].startswith(why), summary
        fit.run(requests(loop))  # the next group of the same step does not try again
        assert fit.lockstep.summary()["steps"] == summary["steps"]


def test_a_batch_norm_with_its_own_forward_steps_by_shape_in_lockstep():
    """Statistics a batch norm subclass computes itself cannot leave padded rows out: its groups step by shape."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), _AdaptingNorm(4), torch.nn.Linear(4, 2))
    loop = _loop({"r": model}, lambda p: torch.optim.SGD(p, lr=0.1))
    sequential, executed, fit = _lockstep(loop, lambda: _streams(loop, [10, 3, 14]))
    _assert_same(sequential, executed, atol=1e-5)
    summary = fit.lockstep.summary()
    assert summary["steps"] == 0 and summary["by_shape_steps"] > 0
    assert summary["refused"] == [
        "r's 1 is a _AdaptingNorm with its own forward, whose statistics would count padded rows"
    ]


def test_the_padding_check_runs_once_per_group(monkeypatch):
    """A client of one example pads every step; the check (three losses of one client) runs at the group's first
    padded step only, and, being made on one real row, again in the next group (a check on two rows or more
    holds for the run)."""
    torch.manual_seed(0)
    loop = _loop({"r": torch.nn.Linear(3, 2)}, lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(13, 3), torch.randint(0, 2, (13,))
    losses, real_client_loss = [], group_training.GroupTraining.client_loss
    monkeypatch.setattr(
        group_training.GroupTraining, "client_loss", lambda self, *a: losses.append(1) or real_client_loss(self, *a)
    )

    def requests():
        made = []
        for k, idx in enumerate([torch.tensor([12]), torch.arange(12)]):  # 3 steps of 1 and of 4 examples
            request = _request(loop, "r", [])
            request.batches = batch_stream(x, y, idx, 4, 3, torch.Generator().manual_seed(k))
            made.append(request)
        return made

    fit = B.BatchedFit(loop, lockstep=True)
    fit.run(requests())
    assert fit.lockstep.counts["padded_client_steps"] == 3 and len(losses) == 3
    fit.run(requests())
    assert fit.lockstep.counts["padded_client_steps"] == 6 and len(losses) == 6


def test_random_layers_are_those_that_draw_in_the_fit():
    """Dropout of every kind with p > 0 and RReLU draw random numbers in training mode; in the fitted role they
    count whatever their mode (the fit trains it), in another role only in training mode (an evaluation-mode
    teacher draws nothing)."""
    from fl_lightning.client.batched.randomness import random_layers

    student = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.0), torch.nn.Dropout2d(0.1))
    teacher = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.RReLU(), torch.nn.AlphaDropout(0.5))
    loop = _loop({"student": student, "teacher": teacher}, lambda p: torch.optim.SGD(p, lr=0.1))
    student.eval()  # the fit puts it into training mode: its dropout still draws
    teacher.eval()
    modes = fit_request.training_modes(loop)
    assert random_layers(loop, "student", modes) == ["student: 2 (Dropout2d)"]
    teacher.train()
    assert random_layers(loop, "student", fit_request.training_modes(loop)) == [
        "student: 2 (Dropout2d)",
        "teacher: 1 (RReLU)",
        "teacher: 2 (AlphaDropout)",
    ]
    assert random_layers(loop, "teacher", modes) == ["teacher: 1 (RReLU)", "teacher: 2 (AlphaDropout)"]
