"""The communication ledger: bytes of every payload sent down to and up from clients."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from .types import Payload


class CommunicationLedger:
    """Counts payload bytes per round, per direction and per payload name.

    The orchestrator records every ``ClientTask.downlink`` and ``ClientUpdate.uplink``; strategies
    never report sizes themselves, so a payload cannot be forgotten.
    """

    def __init__(self) -> None:
        self.per_round: dict[int, dict[str, int]] = {}
        self.by_payload: dict[str, dict[str, int]] = {"uplink": defaultdict(int), "downlink": defaultdict(int)}

    def record(self, rnd: int, direction: str, payloads: Mapping[str, Payload]) -> int:
        """Adds the payloads one client sent (``uplink``) or received (``downlink``); returns their bytes."""
        return self.record_sizes(rnd, direction, {name: payload.nbytes for name, payload in payloads.items()})

    def record_sizes(self, rnd: int, direction: str, sizes: dict[str, int]) -> int:
        """:meth:`record` from the payloads' sizes (another rank's update, before it is unpacked)."""
        if direction not in ("uplink", "downlink"):
            raise ValueError(f"direction must be uplink or downlink, got {direction!r}")
        row = self.per_round.setdefault(rnd, {"uplink": 0, "downlink": 0})
        for name, size in sizes.items():
            self.by_payload[direction][name] += size
        row[direction] += sum(sizes.values())
        return sum(sizes.values())

    @property
    def uplink_bytes(self) -> int:
        return sum(r["uplink"] for r in self.per_round.values())

    @property
    def downlink_bytes(self) -> int:
        return sum(r["downlink"] for r in self.per_round.values())

    def summary(self) -> dict:
        return {
            "uplink_bytes": self.uplink_bytes,
            "downlink_bytes": self.downlink_bytes,
            "by_payload": {d: dict(v) for d, v in self.by_payload.items()},
        }

    def state_dict(self) -> dict:
        return {"per_round": dict(self.per_round), "by_payload": {d: dict(v) for d, v in self.by_payload.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.per_round = dict(state["per_round"])
        self.by_payload = {d: defaultdict(int, v) for d, v in state["by_payload"].items()}
