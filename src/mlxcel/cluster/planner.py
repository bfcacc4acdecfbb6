"""Where a request should go (spec X): the pure decision behind the Ray Serve request router.

Ranks replicas for one `RoutingKey`: the sticky replica of a named conversation, else the
replica whose prefix tree holds most of the prompt's head, else the least loaded; whenever
the busiest and the idlest replica differ by more than `imbalance_threshold` requests in
flight, load wins over affinity. Knows replicas only by id strings; no Ray, no clocks.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from dataclasses import dataclass

from mlxcel.cluster.prefix_tree import PrefixTree
from mlxcel.cluster.wire import RoutingKey

REASONS = ("pinned", "sticky", "prefix", "balance", "least_loaded", "random_pair")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    policy: str = "prefix"  # prefix | pow2 (Ray Serve's default procedure, the benchmark's baseline)
    imbalance_threshold: int = 4  # requests in flight between busiest and idlest before load wins
    match_threshold: float = 0.1  # share of the prompt head a tree must hold to count as a hit
    max_tree_nodes: int = 65536  # per replica, each node BLOCK_CHARS of text
    max_sticky_keys: int = 65536

    def __post_init__(self) -> None:
        if self.policy not in ("prefix", "pow2"):
            raise ValueError(f"--request-router must be prefix or pow2, not {self.policy!r}")
        if self.imbalance_threshold < 0 or not 0.0 <= self.match_threshold <= 1.0:
            raise ValueError("--route-imbalance must be >= 0 and the match threshold in [0, 1]")


@dataclass(frozen=True, slots=True)
class Plan:
    ranks: list[list[str]]  # most preferred first; the router takes the shortest queue within a rank
    reason: str


class RoutePlanner:
    """Prefix trees, sticky keys and in-flight counts per replica; `plan` ranks, `on_routed` learns."""

    def __init__(self, config: PlannerConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self._trees: dict[str, PrefixTree] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # key -> replica, LRU
        self._in_flight: Counter[str] = Counter()
        self.num_routed: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> requests

    def in_flight(self, replica: str) -> int:
        return self._in_flight[replica]

    def plan(self, replicas: list[str], key: RoutingKey) -> Plan:
        if not replicas:
            return Plan([], "none")
        loads = {replica: self._in_flight[replica] for replica in replicas}
        if key.pinned_replica is not None:  # a gone replica's fan-out call lands elsewhere; the entry dedups
            is_live = key.pinned_replica in replicas
            return Plan([[key.pinned_replica]] if is_live else self._by_load(replicas, loads), "pinned")
        if self.config.policy == "pow2":
            pair = self._rng.sample(replicas, min(2, len(replicas)))
            return Plan([pair], "random_pair")
        if max(loads.values()) - min(loads.values()) > self.config.imbalance_threshold:
            return Plan(self._by_load(replicas, loads), "balance")
        preferred = self._preferred(replicas, key)
        if preferred is not None:
            replica, reason = preferred
            return Plan([[replica], [r for r in replicas if r != replica]], reason)
        return Plan(self._by_load(replicas, loads), "least_loaded")

    def _preferred(self, replicas: list[str], key: RoutingKey) -> tuple[str, str] | None:
        if key.sticky is not None and self._sticky.get(key.sticky) in replicas:
            self._sticky.move_to_end(key.sticky)
            return self._sticky[key.sticky], "sticky"
        if not key.prefix:
            return None
        matches = {replica: self._tree(replica).match_len(key.prefix) for replica in replicas}
        best = max(matches.values())
        if best == 0 or best < self.config.match_threshold * len(key.prefix):
            return None
        tied = [replica for replica, matched in matches.items() if matched == best]
        return min(tied, key=lambda r: self._in_flight[r]), "prefix"

    def _by_load(self, replicas: list[str], loads: dict[str, int]) -> list[list[str]]:
        # Least loaded first; among equals the smallest tree, whose cache has the most room.
        order = sorted(replicas, key=lambda r: (loads[r], self._tree(r).num_nodes, self._rng.random()))
        return [[replica] for replica in order]

    def on_routed(self, replica: str, key: RoutingKey, reason: str) -> None:
        """`replica` took the request: count it in flight and remember its prefix and sticky key."""
        self._in_flight[replica] += 1
        self.num_routed[(replica, reason)] += 1
        if key.pinned_replica is not None:
            return
        if key.prefix:
            self._tree(replica).insert(key.prefix)
        if key.sticky is not None:
            self._sticky[key.sticky] = replica
            self._sticky.move_to_end(key.sticky)
            while len(self._sticky) > self.config.max_sticky_keys:
                self._sticky.popitem(last=False)

    def on_completed(self, replica: str) -> None:
        if self._in_flight[replica] > 0:
            self._in_flight[replica] -= 1

    def forget(self, replica: str) -> None:
        """A replica died or left: its cache is gone, so are its tree and its sticky keys."""
        self._trees.pop(replica, None)
        self._in_flight.pop(replica, None)
        for key in [k for k, r in self._sticky.items() if r == replica]:
            del self._sticky[key]

    def _tree(self, replica: str) -> PrefixTree:
        tree = self._trees.get(replica)
        if tree is None:
            tree = self._trees[replica] = PrefixTree(self.config.max_tree_nodes)
        return tree
