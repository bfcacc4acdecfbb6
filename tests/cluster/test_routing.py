"""Spec X routing without Ray: the prefix tree, the routing key and the planner's decisions."""

from __future__ import annotations

import json
import random

from mlxcel.cluster.planner import PlannerConfig, RoutePlanner
from mlxcel.cluster.prefix_tree import BLOCK_CHARS, PrefixTree
from mlxcel.cluster.routing import routing_key
from mlxcel.cluster.wire import RoutingKey

SYSTEM_A = "You are a pirate. " * 40
SYSTEM_B = "You are a careful lawyer. " * 40


def test_x_prefix_tree_matches_whole_blocks_of_the_head() -> None:
    tree = PrefixTree()
    tree.insert("a" * 200)
    assert tree.match_len("a" * 200) == 3 * BLOCK_CHARS  # the partial last block is not a node
    assert tree.match_len("a" * 100 + "b" * 100) == BLOCK_CHARS
    assert tree.match_len("b" + "a" * 199) == 0  # a prefix tree: a different first block matches nothing


def test_x_prefix_tree_evicts_leaves_before_roots() -> None:
    tree = PrefixTree(max_nodes=4)
    tree.insert("a" * 4 * BLOCK_CHARS)
    tree.insert("b" * 2 * BLOCK_CHARS)  # two older nodes must go: the deepest of the "a" path
    assert tree.num_nodes == 4
    assert tree.match_len("a" * 4 * BLOCK_CHARS) == 2 * BLOCK_CHARS
    assert tree.match_len("b" * 2 * BLOCK_CHARS) == 2 * BLOCK_CHARS


def test_x_routing_key_reads_sticky_fields_in_order_and_the_prompt_text() -> None:
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
            "text": "U"}]}], "user": "u1", "prompt_cache_key": "k1"}
    key = routing_key(((b"x-conversation-id", b"c1"),), json.dumps(body).encode())
    assert key.sticky == "prompt_cache_key:k1" and key.prefix == "system\x1eS\x1euser\x1eU"
    del body["prompt_cache_key"]
    assert routing_key(((b"x-conversation-id", b"c1"),), json.dumps(body).encode()).sticky == "conversation:c1"
    assert routing_key((), json.dumps(body).encode()).sticky == "user:u1"
    anthropic = {"system": "S", "messages": [], "metadata": {"user_id": "a"}}
    assert routing_key((), json.dumps(anthropic).encode()) == RoutingKey("user:a", "S")
    assert routing_key((), b'{"prompt": [1, 2]}').prefix == "1\x1e2"


def test_x_routing_key_never_raises_on_hostile_bodies() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for body in (b"", b"{bad", b"[1]", b'{"messages": 5}', b'{"messages": [' + b'"x",' * 50_000 + b'"y"]}', deep,
                 b'{"prompt": "\\ud800"}'):
        key = routing_key((), body)
        assert key.sticky is None and len(key.prefix) <= 64 * 1024


def _planner(**config: object) -> RoutePlanner:
    return RoutePlanner(PlannerConfig(**config), random.Random(0))  # type: ignore[arg-type]


def test_x_conversations_with_different_prefixes_stay_on_their_replicas() -> None:
    planner = _planner()
    replicas = ["r1", "r2"]
    placed: dict[str, set[str]] = {SYSTEM_A: set(), SYSTEM_B: set()}
    for turn in range(6):
        for system in (SYSTEM_A, SYSTEM_B):
            key = RoutingKey(prefix=system + f" turn {turn}")
            plan = planner.plan(replicas, key)
            chosen = plan.ranks[0][0]
            planner.on_routed(chosen, key, plan.reason)
            planner.on_completed(chosen)
            placed[system].add(chosen)
    assert all(len(chosen) == 1 for chosen in placed.values())  # each prefix on one replica
    assert placed[SYSTEM_A] != placed[SYSTEM_B]  # and the two spread over both


def test_x_load_wins_past_the_imbalance_threshold() -> None:
    planner = _planner(imbalance_threshold=2)
    key = RoutingKey(prefix=SYSTEM_A)
    for _ in range(3):  # three in flight on r1, none finished
        planner.on_routed("r1", key, "prefix")
    plan = planner.plan(["r1", "r2"], key)
    assert plan.reason == "balance" and plan.ranks[0] == ["r2"]
    planner.on_completed("r1")
    assert planner.plan(["r1", "r2"], key).ranks[0] == ["r1"]  # back within the threshold: affinity


def test_x_sticky_key_beats_prefix_and_dies_with_its_replica() -> None:
    planner = _planner()
    planner.on_routed("r2", RoutingKey(sticky="conversation:c"), "least_loaded")
    planner.on_completed("r2")
    planner.on_routed("r1", RoutingKey(prefix=SYSTEM_A), "least_loaded")
    planner.on_completed("r1")
    plan = planner.plan(["r1", "r2"], RoutingKey(sticky="conversation:c", prefix=SYSTEM_A))
    assert (plan.reason, plan.ranks[0]) == ("sticky", ["r2"])
    planner.forget("r2")
    plan = planner.plan(["r1", "r3"], RoutingKey(sticky="conversation:c", prefix=SYSTEM_A))
    assert (plan.reason, plan.ranks[0]) == ("prefix", ["r1"])


def test_x_pinned_calls_and_the_pow2_baseline() -> None:
    planner = _planner(policy="pow2")
    assert planner.plan(["r1", "r2"], RoutingKey(pinned_replica="r2")).ranks == [["r2"]]
    gone = planner.plan(["r1", "r2"], RoutingKey(pinned_replica="r9"))
    assert gone.reason == "pinned" and sorted(r[0] for r in gone.ranks) == ["r1", "r2"]  # never an empty plan
    plan = planner.plan(["r1", "r2", "r3"], RoutingKey(prefix=SYSTEM_A))
    assert plan.reason == "random_pair" and len(plan.ranks) == 1 and len(plan.ranks[0]) == 2
