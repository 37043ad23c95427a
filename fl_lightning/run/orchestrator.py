"""FederationOrchestrator: the only round loop of the code base. It does no algorithm math.

A round: sample clients; per phase of the strategy (``Strategy.phases``, checked once), its ``configure`` (the
downlink), each client's ``client_update`` (one after another, batched, or a rank's share), its ``aggregate``
consuming the updates as they come (a phase without one: its updates are drained); then, by the
:class:`RoundPlan`, evaluate, log and checkpoint. The options arrive checked, in groups (``options.py``,
``robustness.Robustness``): nothing here checks them again.

Every random choice is drawn from a stream derived from (seed, round, client, purpose) (``seeding.py``),
so a resumed run continues exactly where an uninterrupted one would be, and client order does not matter.
What the run has done so far (history, client states, traffic) lives in a :class:`RunState`; the
asynchronous round body lives next to its schedule in ``asynchrony.py``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..client.batched.executor import BatchedExecutor
from ..client.context import ClientContext
from ..client.evaluation import Evaluator, PersonalEvaluation
from ..client.flops import role_step_flops
from ..client.loop import LocalLoop
from ..data import FederatedData
from ..distributed.ranks import current_ranks
from ..federation.errors import ConfigError
from ..federation.sampling import ClientSampler
from ..federation.seeding import Owner, Stream, derive_seed, seed_torch, server_phase
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from ..federation.user_code import user_hook, user_method
from ..strategies.base import ServerContext, Strategy, check_evaluation_split, phase_table
from ..tracking import RoundProgress
from ..tracking import metric_keys as keys
from .asynchrony import AsynchronousRounds, AsynchronousSchedule
from .client_store import CLIENTS_DIR
from .options import ExecutionPlan, RoundPlan, RunOutput
from .privacy import Privacy, PrivacyMechanism
from .remote import ClientTransport
from .robustness import FIX, LOWER_RATES, Diverged, Robustness, nonfinite_metrics, nonfinite_parts, poison
from .sharding import ShardedPhases
from .state import RunState
from .tally import RoundTally, TrainedRound


class FederationOrchestrator:
    """Runs rounds: sample -> configure -> local updates -> aggregate -> evaluate -> log -> checkpoint.

    Args:
        strategy: the federated algorithm.
        clients: the population's clients.
        sampler: picks each round's clients.
        loop: the local training loop (owns one model instance per role).
        data: the federated data, already set up.
        seed: the run seed.
        plan: the rounds, and after which of them to evaluate, checkpoint and stop.
        output: the run directory, the loggers, and what the summary and checkpoints say about the run.
        execution: how a phase's clients run (one after another or batched) and the client-state memory.
        robustness: the faults injected into the clients and the divergence policy.
        schedule: asynchronous mode (simulated clock and client speeds); synchronous rounds when None.
        evaluation: which clients a personalized evaluation covers (all of them at every evaluation by default).
        privacy: differential privacy of every client upload (``privacy.py``); none when None.
        transport: clients in other processes (Flower's SuperNodes, ``run/remote.py``): each phase's tasks go
            through it instead of the local loop; the rest of the round is this loop's, as always.

    Example::

        orchestrator = FederationOrchestrator(
            strategy=FedAvg(), clients=clients, sampler=UniformSampler(), loop=loop, data=data, seed=0,
            plan=RoundPlan(rounds=5), output=RunOutput(RunFiles("runs/try")),
        )
        summary = orchestrator.run_rounds()  # what summary.json holds

    The loggers of ``output`` write the rows: without the CSV logger (``resolve_loggers`` adds it, ``flrun
    fit`` starts it) the run writes no metrics.csv.
    """

    def __init__(
        self,
        *,
        strategy: Strategy,
        clients: list[ClientSpec],
        sampler: ClientSampler,
        loop: LocalLoop,
        data: FederatedData,
        seed: int,
        plan: RoundPlan,
        output: RunOutput,
        execution: ExecutionPlan = ExecutionPlan(),  # noqa: B008 (frozen)
        robustness: Robustness = Robustness(),  # noqa: B008 (frozen)
        schedule: AsynchronousSchedule | None = None,
        evaluation: PersonalEvaluation | None = None,
        privacy: Privacy | None = None,
        transport: ClientTransport | None = None,
    ):
        self.strategy, self.clients, self.sampler = strategy, clients, sampler
        self.loop, self.data, self.seed = loop, data, seed
        self.plan, self.output, self.execution, self.robustness = plan, output, execution, robustness
        self.files, self.loggers = output.files, output.loggers
        self.ranks = current_ranks()  # one process, or one of several that share each phase's clients
        client_dir = self.files.checkpoints / CLIENTS_DIR if self.ranks.writes else self.ranks.scratch  # rank 0 alone
        assert client_dir is not None, "connect_ranks gives every rank but 0 a scratch folder"
        memory = execution.client_state_memory_mb
        self.state = RunState(client_dir, output.run_info, output.config, memory, loop.fabric.device, self.ranks.rank)
        self.evaluator = Evaluator(loop, data, clients, self.state.client_states, evaluation, seed)
        self.schedule = schedule
        self.transport = transport
        batched = execution.executor == "batched"
        self.batched = BatchedExecutor(loop, execution.batch_clients, execution.lockstep) if batched else None
        self.sharded = (
            ShardedPhases(self.ranks, self.state, loop, self._crashes, strategy.state_dict)
            if self.ranks.world > 1
            else None
        )
        server = ServerContext(clients, list(loop.slots), data, plan.rounds, seed, loop)
        with user_hook(strategy, "Strategy", "setup"):
            strategy.setup(server)
        check_evaluation_split(strategy, server)
        self.phases = phase_table(strategy)  # once: the round loop reads phases, never phase names
        self.client_work = {phase.name: phase.client_update for phase in self.phases}
        self.phase_numbers = {phase.name: number for number, phase in enumerate(self.phases)}
        self.privacy = None if privacy is None else self._privacy(privacy, server)
        self.asynchronous = (
            AsynchronousRounds(
                schedule, self.phases, clients, self.state.ledger, seed, self._run_client, robustness.faults
            )
            if schedule is not None
            else None
        )
        self.monitor = output.monitor or strategy.monitor
        # after setup, which may freeze a backbone: a frozen parameter's gradient is not computed, nor counted;
        # only the roles clients train (a server's model, such as FedKTL's generator, is no local training)
        trained = {role for client in clients for role in client.roles}
        models = {role: slot.module.model for role, slot in loop.slots.items() if role in trained}
        self.step_flops, self.uncounted = role_step_flops(models, data.x[:1], loop.training.batch_size)
        if self.uncounted:
            self.state.train_flops = None  # a role's steps without their cost: no total rather than a low one

    def _privacy(self, privacy: Privacy, server: ServerContext) -> PrivacyMechanism:
        """The run's privacy mechanism, once its plan is checked (refused before round 1 in one sentence)."""
        method = type(self.strategy).__name__
        if self.schedule is not None:
            raise ConfigError(
                "privacy accounts synchronous rounds only; remove schedule (asynchronous mode) or privacy."
            )
        if privacy.where == "server" and not self.strategy.central_privacy:
            raise ConfigError(
                f"privacy where: server needs an aggregate that is a sum or mean of the uploads, and {method}'s "
                "server uses each upload on its own; use where: client."
            )
        if privacy.where == "server" and getattr(self.strategy, "clients_per_round", None):
            raise ConfigError(
                f"privacy where: server counts the clients the sampler draws, and {method}'s clients_per_round draws "
                "its own; remove clients_per_round or use where: client."
            )
        # the phases whose uploads the server uses: one without an aggregate drops its uploads, releasing nothing
        released = max(1, sum(phase.aggregate is not None for phase in self.phases))
        mechanism = PrivacyMechanism(
            privacy,
            self.sampler,
            len(self.clients),
            self.plan.rounds,
            released,
            self.data.num_classes,
            self.seed,
            population=self.clients if privacy.where == "server" else None,
        )
        server.whole_class_tables = True
        if privacy.where == "server":
            server.central_noise = mechanism.central_noise
        return mechanism

    # ------------------------------------------------------------------ the round loop
    def run_rounds(self, checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
        """Runs the remaining rounds (all of them, or those after ``checkpoint``); returns the summary."""
        state = self.state
        if checkpoint is not None:
            state.restore(checkpoint, self.strategy, self.loop, self.schedule)
            if self.privacy is not None and state.privacy is not None:  # the noise multiplier of the rounds done
                self.privacy.load_state_dict(state.privacy)
            state.use_monitor(self.monitor)
        else:
            state.client_states.start()  # client files a killed start left behind go
        if self.privacy is not None:
            state.privacy = self.privacy.state_dict()
        device = self.loop.fabric.device.type
        self.progress = RoundProgress(self.output.progress, self.plan.rounds, state.rounds_done, self.monitor, device)
        started = time.perf_counter() - state.elapsed
        try:
            # a resume past its --stop_after round trains nothing (a job chain's rerun), and rewrites the summary
            for rnd in self.plan.rounds_to_run(state.rounds_done):
                self._run_round(rnd, started)
        except Diverged as err:  # the last good checkpoint stays; the summary says what happened, never a null
            self._write_summary({"diverged": True, "diverged_round": err.round, "diverged_reason": str(err)})
            raise
        finally:
            self.progress.close()
        return self._write_summary({"diverged": False})

    def _run_round(self, rnd: int, started: float) -> None:
        """Round ``rnd``: training, then, by the plan, evaluation; its row logged; a checkpoint by the plan."""
        state, plan = self.state, self.plan
        self.progress.start_round(rnd)
        row = self._train(rnd)
        metrics = None
        if plan.evaluates(rnd):
            self.evaluator.begin(rnd, final=rnd == plan.rounds)
            with user_hook(self.strategy, "Strategy", "evaluate"):
                evaluated = self.strategy.evaluate(self.evaluator)
            metrics = {**evaluated, **self.evaluator.validation_metrics()}
        self._check_finite(rnd, {**row, **(metrics or {})})
        if self.privacy is not None:  # spent after this round's uploads (infinite without noise)
            row[keys.PRIVACY_EPSILON] = self.privacy.epsilon(rnd)
        state.rounds_done = rnd
        state.elapsed = time.perf_counter() - started
        row[keys.ELAPSED_S] = state.elapsed
        if metrics is not None:
            state.record_evaluation(rnd, metrics, self.monitor, self.evaluator.per_client)
            row.update(metrics)
            state.history.append(row)
            for logger in self.loggers:  # before any logger's row: a pruning logger may stop the run there
                logger.log_evaluation(state.history)
        for logger in self.loggers:  # rank 0's alone (the other ranks have none)
            logger.log_metrics({k: v for k, v in row.items() if k != keys.ROUND}, step=rnd)
        self.progress.update(rnd, row)
        if plan.checkpoints(rnd) and self.ranks.writes:
            state.save(self.files.last_checkpoint, self.strategy, self.loop, self.loggers, self.schedule)

    def _write_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        state = self.state
        summary = state.summary(self.seed, self.plan.rounds, self.monitor, self.files.root)
        summary.update(extra)
        if self.batched is not None:  # how many local fits really ran batched (the rest could not)
            summary["executor"] = {"mode": "batched", **self.batched.fits.counts}
            if self.batched.fits.sequential_reasons:
                summary["executor"]["sequential_reasons"] = dict(self.batched.fits.sequential_reasons)
            if self.batched.fits.lockstep is not None:  # steps of all of a group's clients, and how many padded
                summary["executor"]["lockstep"] = self.batched.fits.lockstep.summary()
        elif self.execution.sequential_because is not None:  # batched was asked for and could not be
            summary["executor"] = {"mode": "sequential", "why": self.execution.sequential_because}
        if self.loop.graphs is not None:  # how many steps were replayed from CUDA graphs, and why others were not
            summary["cuda_graphs"] = self.loop.graphs.summary()
        if self.robustness.may_lose_updates:
            summary["faults"] = {k: state.events.get(k, 0) for k in self.robustness.event_keys}
        summary["ranks"] = state.shares.summary()
        summary["compute"] = {"train_flops": state.train_flops, "step_flops": dict(self.step_flops)}
        if self.uncounted:
            summary["compute"]["not_counted"] = dict(self.uncounted)
        if self.privacy is not None:
            summary["privacy"] = self.privacy.summary(state.rounds_done)
        if self.ranks.writes:
            self.files.write_json(self.files.summary, summary)
        return summary

    def _check_finite(self, rnd: int, row: dict[str, Any]) -> None:
        """Stops the run when the server's or an evaluation's metrics are not finite (whatever the policy)."""
        bad = nonfinite_metrics(row)
        if bad:
            raise Diverged(
                f"round {rnd} diverged: {', '.join(sorted(bad)[:4])} {'is' if len(bad) == 1 else 'are'} not finite "
                f"(the server state or an evaluation); {LOWER_RATES}.",
                rnd,
            )

    def _train(self, rnd: int) -> dict[str, Any]:
        """The training part of round ``rnd``; returns its row: clients, train and server metrics, losses, traffic."""
        tally = RoundTally()
        if self.asynchronous is None:
            trained = self._synchronous(rnd, tally)
        else:
            trained = self.asynchronous.run_round(rnd, tally)
        ledger = self.state.ledger
        traffic = ledger.per_round.get(rnd, {"uplink": 0, "downlink": 0})
        client_metrics = tally.client_metrics
        row: dict[str, Any] = {keys.ROUND: rnd, keys.CLIENTS: trained.tasks}
        row.update({keys.train_key(k): float(np.mean(v)) for k, v in client_metrics.items()})
        if client_metrics:
            row[keys.TRAIN_LOSS] = float(np.mean([np.mean(v) for k, v in client_metrics.items() if k.endswith("loss")]))
        row.update(trained.server_metrics)
        if self.robustness.may_lose_updates:
            row.update({keys.faults_key(k): tally.events.get(k, 0) for k in self.robustness.event_keys})
            for key, count in tally.events.items():
                self.state.events[key] = self.state.events.get(key, 0) + count
        row.update(
            {
                keys.ROUND_UPLINK_BYTES: traffic["uplink"],
                keys.ROUND_DOWNLINK_BYTES: traffic["downlink"],
                keys.UPLINK_BYTES: ledger.uplink_bytes,
                keys.DOWNLINK_BYTES: ledger.downlink_bytes,
                keys.MIB_PER_CLIENT: (ledger.uplink_bytes + ledger.downlink_bytes) / len(self.clients) / 2**20,
            }
        )
        if self.state.train_flops is not None:  # None: a role's step could not be counted (summary.json says why)
            self.state.train_flops += sum(n * self.step_flops[role] for role, n in tally.steps.items())
            row[keys.TRAIN_FLOPS] = self.state.train_flops
            row[keys.GFLOPS_PER_CLIENT] = self.state.train_flops / len(self.clients) / 1e9
        return row

    def _synchronous(self, rnd: int, tally: RoundTally) -> TrainedRound:
        """One synchronous round: every phase's tasks, their updates streamed into ``aggregate``."""
        rng = np.random.default_rng(derive_seed(self.seed, rnd, Owner.SERVER, Stream.SAMPLER))
        sampled = self.sampler.sample(rnd, self.clients, rng)
        if self.privacy is not None:
            self.privacy.begin_round(rnd)
        num_tasks, server_metrics = 0, {}
        for number, phase in enumerate(self.phases):
            with user_method(phase.configure):
                tasks = phase.configure(rnd, sampled)
            for task in tasks:
                task.phase = phase.name
            num_tasks += len(tasks)
            self.progress.start_phase(phase.name, len(tasks))
            if self.transport is not None:  # the clients run elsewhere; their updates come back in task order
                updates = self.transport.updates(self, rnd, tasks, tally)
            elif self.sharded is None:
                updates = self._client_updates(rnd, tasks, tally)
            else:  # this rank trains its share; every rank gets every update, in task order (sharding.py)
                updates = self.sharded.updates(rnd, tasks, self._client_updates, tally, self.progress)
            if self.robustness.may_lose_updates or self.sampler.may_be_empty:  # is any update left?
                first = next(updates, None)
                if first is None:  # the server keeps its state; aggregate never sees an empty phase
                    tally.count("phases_without_updates")
                    continue
                updates = itertools.chain([first], updates)
            seed_torch(derive_seed(self.seed, rnd, Owner.SERVER, server_phase(number)))  # server-side randomness
            if phase.aggregate is None:  # the server uses nothing of this phase: its clients run, their updates go
                collections.deque(updates, maxlen=0)
                continue
            with user_method(phase.aggregate):
                server_metrics.update(phase.aggregate(rnd, updates) or {})
            if next(updates, None) is not None:
                raise RuntimeError(
                    f"{type(self.strategy).__name__}'s aggregate of phase {phase.name!r} did not consume every "
                    "client update"
                )
        return TrainedRound(num_tasks, server_metrics)

    def _client_updates(self, rnd: int, tasks: list[ClientTask], tally: RoundTally) -> Iterator[ClientUpdate]:
        """Runs clients (one at a time, or a chunk batched) as the strategy's ``aggregate`` asks for their updates."""
        self.loop.begin_phase()
        updates: Iterator[ClientUpdate | None]
        if self.batched is None:
            updates = (self._run_client(rnd, task, tally) for task in tasks)
        else:
            updates = self.batched.run([functools.partial(self._run_client, rnd, task, tally) for task in tasks])
        for update in updates:
            if update is not None:  # a lost update sends nothing
                self.state.ledger.record(rnd, "uplink", update.uplink)
                yield update

    def run_client(self, rnd: int, task: ClientTask, tally: RoundTally) -> ClientUpdate | None:
        """Runs one client's task as this loop does (its downlink recorded, faults, the client's state kept): the
        client side of a transport (``run/remote.py``) runs each task it receives with it."""
        return self._run_client(rnd, task, tally)

    def _run_client(self, rnd: int, task: ClientTask, tally: RoundTally, stream: int = 0) -> ClientUpdate | None:
        """Runs one client's task with its own random streams (``stream`` > 0: one of several in a round).

        Returns the update the server receives, its metrics recorded in ``tally``; None when the update is lost
        (an injected fault, or a non-finite update under ``divergence: drop``), counted in ``tally``.
        """
        self.state.ledger.record(rnd, "downlink", task.downlink)
        client = task.client
        fault = self.robustness.fault_of(self.seed, rnd, client.id, stream)
        if fault == "crash":  # it fails before sending anything: its state stays as it was
            tally.count("crash")
            self.progress.client_done()
            return None
        seed_torch(derive_seed(self.seed, rnd, client.id, Stream.DROPOUT, *((stream,) if stream else ())))
        client_states = self.state.client_states
        ctx = ClientContext(client, rnd, self.loop, self.data, client_states.open(client.id), self.seed, stream)
        work = self.client_work[task.phase]
        with user_method(work):
            update = work(task, ctx)
        if self.privacy is not None:  # clipped (and noised) before it leaves the client
            update = self.privacy.privatize(type(self.strategy).__name__, task, update, self.phase_numbers[task.phase])
        ctx.finish()
        self.state.shares.trained(client.id)  # summary.json's ranks block
        tally.add_steps(ctx.trained_steps)  # trained, whether or not its update arrives
        client_states.close(client.id, ctx.state)  # kept, or written to its file beyond the memory budget
        self.progress.client_done()
        if not self._received(rnd, client, update, fault, tally):
            return None
        tally.add_metrics(update.metrics)
        return update

    def _received(
        self, rnd: int, client: ClientSpec, update: ClientUpdate, fault: str | None, tally: RoundTally
    ) -> bool:
        """Whether the server receives a trained client's ``update``, after its injected ``fault`` and the
        divergence policy (a non-finite update stops the run, or is dropped); a lost one is counted in ``tally``."""
        if fault == "nan":
            tally.count("nan")
            poison(update)
        elif fault == "drop_upload" or (fault == "straggle" and self.asynchronous is None):
            tally.count(fault)  # trained, but the server never receives it (past the deadline, or lost)
            return False
        elif fault == "straggle":
            tally.count(fault)  # asynchronous mode: it arrives late (AsynchronousRounds delays it)
        bad = nonfinite_parts(update)
        if not bad:
            return True
        if self.robustness.divergence == "stop":
            injected = " (an injected nan fault)" if fault == "nan" else ""
            raise Diverged(
                f"round {rnd} diverged: client {client.id} sent non-finite {', '.join(bad[:4])}{injected}; {FIX}.",
                rnd,
            )
        tally.count("dropped_nonfinite")
        return False

    def _crashes(self, rnd: int, task: ClientTask) -> bool:
        """Whether the task's client crashes before training (an injected fault): it never trains."""
        return self.robustness.fault_of(self.seed, rnd, task.client.id) == "crash"
