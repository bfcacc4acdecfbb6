"""Spec X fan-out answers merged at the entry point (pure functions, no Ray)."""

from __future__ import annotations

from mlxcel.cluster.entry import (cluster_metrics, find_slot, merge_cache_reset, merge_health, merge_metrics,
                                  merge_slots)

REPLICA_METRICS = """# HELP mlxcel_requests_total Chat completions.
# TYPE mlxcel_requests_total counter
mlxcel_requests_total 3.0
# HELP mlxcel_worker_queue_depth Queue depth.
# TYPE mlxcel_worker_queue_depth gauge
mlxcel_worker_queue_depth{worker="embedding"} 0.0
"""


def _health(status: str, active: int) -> dict[str, object]:
    return {"status": status, "model": "m", "batch": {"active_sequences": active, "queue_depth": 0, "max_batch_size": 2},
            "observability": {"sequences_started": 5, "sequences_completed": 4}, "context_size": 1024}


def test_x_health_sums_batches_and_is_ok_while_any_replica_is() -> None:
    status, body = merge_health([("a", 503, _health("no slot available", 2)), ("b", 200, _health("ok", 1))])
    assert status == 200 and body["status"] == "ok" and body["context_size"] == 1024
    assert body["batch"] == {"active_sequences": 3, "queue_depth": 0, "max_batch_size": 4}
    assert body["observability"] == {"sequences_started": 10, "sequences_completed": 8}
    assert [r["replica"] for r in body["replicas"]] == ["a", "b"]
    status, body = merge_health([("a", 503, _health("no slot available", 2))])
    assert status == 503 and body["status"] == "no slot available"


def test_x_metrics_families_once_with_replica_labels() -> None:
    text = merge_metrics([("a", REPLICA_METRICS), ("b", REPLICA_METRICS)])
    lines = text.splitlines()
    assert lines.count("# TYPE mlxcel_requests_total counter") == 1
    assert 'mlxcel_requests_total{replica="a"} 3.0' in lines and 'mlxcel_requests_total{replica="b"} 3.0' in lines
    assert 'mlxcel_worker_queue_depth{replica="b",worker="embedding"} 0.0' in lines
    # samples of a family follow its HELP/TYPE lines, as the exposition format requires
    assert lines.index('mlxcel_requests_total{replica="b"} 3.0') < lines.index("# HELP mlxcel_worker_queue_depth "
                                                                                "Queue depth.")
    counts = cluster_metrics(["a", "b"], {("a", "prefix"): 2})
    assert "mlxcel_cluster_replicas 2" in counts and 'mlxcel_cluster_routed_total{replica="a",reason="prefix"} 2' in counts


def test_x_slots_numbered_across_replicas_and_found_back() -> None:
    answers = [("a", [{"id": 0}, {"id": 1}]), ("b", [{"id": 0}, {"id": 1}])]
    merged = merge_slots(answers)
    assert [(s["id"], s["replica"], s["replica_slot_id"]) for s in merged] == [
        (0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)]
    assert find_slot("2", answers) == ("b", 0)
    assert find_slot("9", answers) is None and find_slot("x", answers) is None


def test_x_cache_reset_sums_each_tiers_drops() -> None:
    """Issue 29: a cluster reset reports what every replica dropped, RAM, host and disk."""
    def reply(reset: bool, blocks: int, files: int) -> dict[str, object]:
        return {"object": "prompt_cache.reset", "enabled": True, "reset": reset,
                "dropped": {"blocks": blocks, "host_blocks": 0, "disk_files": files, "disk_bytes": files * 10}}
    body = merge_cache_reset([reply(True, 3, 2), reply(False, 0, 0), reply(True, 1, 5)])
    assert body == {"object": "prompt_cache.reset", "enabled": True, "reset": True,
                    "dropped": {"blocks": 4, "host_blocks": 0, "disk_files": 7, "disk_bytes": 70}}
