"""The prefix cache's disk tier (issue 29) on tiny KV tensors: exact bytes back, bad files dropped, the bound kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskBlockStore, DiskTierConfig, LoadPolicy, open_disk_tier
from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.kv.tensors import KVCache

from .kv_tiers import block_rows, compute

BLOCK = 4
NUM_BLOCKS = 8
IDENTITY = "ab" * 32


class Engine:
    """A pool, a manager and a cache with a disk tier under them: one 'process' of the tests."""

    def __init__(self, folder: Path, *, k_type: str = "bf16", identity: str = IDENTITY,
                 capacity: int = 1 << 30, values_are_keys: bool = False,
                 layer_shapes: tuple[tuple[int, int], ...] | None = None) -> None:
        self.cache = KVCache(2, NUM_BLOCKS, BLOCK, 2, 32, torch.bfloat16, "cpu", k_type=k_type, v_type=k_type,
                             values_are_keys=values_are_keys, layer_shapes=layer_shapes)
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=True)
        self.store: DiskBlockStore = open_disk_tier(DiskTierConfig(folder, capacity, identity), self.cache, self.pool)
        self.kv.lower_tier = self.store

    def compute(self, request_id: str, tokens: list[int]) -> list[int]:
        return compute(self.kv, self.cache, request_id, tokens)

    def rows(self, block_ids: list[int]) -> list[torch.Tensor]:
        return block_rows(self.cache, block_ids)


def prompt(seed: int, num_tokens: int = 3 * BLOCK + 1) -> list[int]:
    return [seed * 1000 + i for i in range(num_tokens)]


def restart(engine: Engine, folder: Path, **options: object) -> Engine:
    engine.store.close(engine.pool)  # the graceful stop: every cached block saved, the writer drained
    return Engine(folder, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("k_type", ["bf16", "q8_0"])
def test_restart_restores_the_exact_blocks(tmp_path: Path, k_type: str) -> None:
    first = Engine(tmp_path, k_type=k_type)
    tokens = prompt(1)
    table = first.compute("a", tokens)
    saved = first.rows(table[:3])
    second = restart(first, tmp_path, k_type=k_type)
    blocks, num_cached = second.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK and len(blocks) == 3
    assert all(torch.equal(a, b) for a, b in zip(saved, second.rows(blocks)))
    stats = second.store.stats()
    assert (stats.num_hits, stats.num_blocks_read, stats.num_bad_files) == (1, 3, 0)


@pytest.mark.parametrize("k_type", ["bf16", "q8_0"])
def test_issue40_a_keys_only_cache_saves_and_restores_its_keys(tmp_path: Path, k_type: str) -> None:
    """MLA's cache (values are keys) round-trips through the disk tier, and its files hold keys only."""
    first = Engine(tmp_path, k_type=k_type, values_are_keys=True)
    assert first.cache.v is first.cache.k and "v" not in first.cache.named_tensors()
    tokens = prompt(2)
    saved = first.rows(first.compute("a", tokens)[:3])
    second = restart(first, tmp_path, k_type=k_type, values_are_keys=True)
    blocks, num_cached = second.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK
    assert all(torch.equal(a, b) for a, b in zip(saved, second.rows(blocks)))
    full = Engine(tmp_path / "kv", k_type=k_type)
    full.compute("a", tokens)
    full.store.close(full.pool)
    keys_only = sum(f.stat().st_size for f in tmp_path.glob(f"{IDENTITY[:32]}/*.kvb"))
    both = sum(f.stat().st_size for f in (tmp_path / "kv").glob(f"{IDENTITY[:32]}/*.kvb"))
    assert keys_only and both
    assert keys_only < 0.6 * both
    assert second.kv.find_cached_prefix(tokens, cache_prompt=True)[1] == 3 * BLOCK  # now from RAM
    assert second.store.stats().num_hits == 1


@pytest.mark.parametrize("k_type", ["bf16", "q8_0"])
def test_issue40_a_cache_of_two_head_shapes_saves_and_restores_every_layer(tmp_path: Path, k_type: str) -> None:
    """Gemma 4's cache (global layers with another head size and KV-head count): the layers of each shape are
    one stacked tensor (the first shape's named as before), and blocks round-trip through the disk tier."""
    shapes = ((2, 32), (1, 64), (2, 32))
    first = Engine(tmp_path, k_type=k_type, layer_shapes=shapes)
    assert [tuple(layer.shape[1:]) for layer in first.cache.k] == [(2, 32), (1, 64), (2, 32)]
    assert [name for name in first.cache.stacked_tensors() if "scales" not in name] == ["k", "v", "k.1", "v.1"]
    assert first.cache.stacked_tensors()["k"].shape[0] == 2 and first.cache.stacked_tensors()["k.1"].shape[0] == 1
    tokens = prompt(3)
    saved = first.rows(first.compute("a", tokens)[:3])
    second = restart(first, tmp_path, k_type=k_type, layer_shapes=shapes)
    blocks, num_cached = second.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK
    assert all(torch.equal(a, b) for a, b in zip(saved, second.rows(blocks)))
    assert second.store.stats().num_bad_files == 0


def test_issue40_a_slot_file_of_two_head_shapes_restores_every_layer(tmp_path: Path) -> None:
    """F12 slot files on Gemma 4's cache: every stacked tensor of each shape is saved and written back, and a
    cache of another shape refuses the file."""
    from mlxcel.engine.kv.slot_files import SlotError, restore_slot, save_slot
    from mlxcel.engine.scheduler import SlotContent

    shapes = ((2, 32), (1, 64), (2, 32))
    first = Engine(tmp_path / "a", layer_shapes=shapes)
    tokens = prompt(4)
    saved = first.rows(first.compute("a", tokens)[:3])
    path = tmp_path / "slot.bin"
    save_slot(first.kv, first.cache, SlotContent(tokens), (), 0, path)
    second = Engine(tmp_path / "b", layer_shapes=shapes)
    result, _ = restore_slot(second.kv, second.cache, 0, path, ())
    assert result.num_tokens == 3 * BLOCK
    blocks, num_cached = second.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK
    assert all(torch.equal(a, b) for a, b in zip(saved, second.rows(blocks)))
    other = Engine(tmp_path / "c", layer_shapes=((2, 32), (2, 32), (2, 32)))
    with pytest.raises(SlotError, match="another KV shape"):
        restore_slot(other.kv, other.cache, 0, path, ())


def test_eviction_writes_blocks_before_they_are_overwritten(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    tokens = prompt(1)
    saved = engine.rows(engine.compute("a", tokens)[:3])
    engine.compute("b", prompt(2, NUM_BLOCKS * BLOCK))  # takes every block: "a"'s three are evicted
    assert engine.kv.pool.num_evictions == 3
    fresh = restart(engine, tmp_path)
    blocks, num_cached = fresh.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK and all(torch.equal(a, b) for a, b in zip(saved, fresh.rows(blocks)))


def test_another_identity_or_kv_type_never_reuses(tmp_path: Path) -> None:
    first = Engine(tmp_path)
    tokens = prompt(1)
    first.compute("a", tokens)
    other = restart(first, tmp_path, identity="cd" * 32)
    assert other.kv.find_cached_prefix(tokens, cache_prompt=True) == ([], 0)
    assert other.store.stats().num_misses == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_bad_files_are_skipped_and_removed(tmp_path: Path, damage: str) -> None:
    first = Engine(tmp_path)
    tokens = prompt(1)
    first.compute("a", tokens)
    first.store.close(first.pool)
    files = sorted(first.store.folder.glob("*.kvb"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 3
    target = next(p for p in files if p.stem == f"{_second_block_hash(tokens):064x}")
    data = target.read_bytes()
    if damage == "flip":
        target.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:  # the first block's file (another key) copied under the second's name
        target.write_bytes(next(p for p in files if p != target and p.stem != target.stem).read_bytes())
    second = Engine(tmp_path)
    blocks, num_cached = second.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == BLOCK  # the first block only: the chain stops at the bad file
    assert not target.exists() and second.store.stats().num_bad_files == 1


def _second_block_hash(tokens: list[int]) -> int:
    from mlxcel.engine.kv.prefix import hash_prompt_blocks

    return hash_prompt_blocks(tokens[: 2 * BLOCK], BLOCK)[1]


def test_capacity_keeps_the_most_recently_used(tmp_path: Path) -> None:
    probe = Engine(tmp_path)
    probe.compute("a", prompt(1))
    probe.store.close(probe.pool)
    file_size = next(probe.store.folder.glob("*.kvb")).stat().st_size
    engine = Engine(tmp_path / "bounded", capacity=4 * file_size)
    for seed in range(2, 8):  # 3 blocks each, 18 in all
        engine.compute(str(seed), prompt(seed))
    engine.store.close(engine.pool)
    sizes = [p.stat().st_size for p in (tmp_path / "bounded").glob("*/*.kvb")]
    assert 0 < sum(sizes) <= 4 * file_size


def test_graceful_stop_saves_the_most_recently_used_within_the_capacity(tmp_path: Path) -> None:
    probe = Engine(tmp_path / "probe")
    probe.compute("a", prompt(1))
    probe.store.close(probe.pool)
    file_size = next(probe.store.folder.glob("*.kvb")).stat().st_size
    # room for 3 files, not 4 (a file's size varies by a byte or so: its checksum's digits)
    engine = Engine(tmp_path / "bounded", capacity=3 * file_size + file_size // 2)
    engine.compute("old", prompt(1))
    engine.compute("new", prompt(2))  # 8 blocks: both prompts stay in RAM, nothing is evicted
    fresh = restart(engine, tmp_path / "bounded")
    assert fresh.kv.find_cached_prefix(prompt(2), cache_prompt=True)[1] == 3 * BLOCK
    assert fresh.kv.find_cached_prefix(prompt(1), cache_prompt=True)[1] == 0


def test_reset_deletes_this_identitys_files_even_with_writes_pending(tmp_path: Path) -> None:
    """POST /v1/cache/reset's disk part: pending writes never land after it; another identity's files stay."""
    other = Engine(tmp_path, identity="cd" * 32)
    other.compute("x", prompt(9))
    other.store.close(other.pool)
    engine = Engine(tmp_path)
    engine.compute("a", prompt(1))
    engine.store.save(engine.pool.cached_blocks())  # queued for the writer, maybe not written yet
    num_files, num_bytes = engine.store.reset()
    assert num_files <= 3 and num_bytes == num_files * (num_bytes // max(num_files, 1))
    assert not list(engine.store.folder.glob("*.kvb")) and engine.store.stats().num_files == 0
    assert len(list(other.store.folder.glob("*.kvb"))) == 3  # the other model's blocks survive
    engine.pool.clear_free_cached_blocks()
    fresh = restart(engine, tmp_path)
    assert fresh.kv.find_cached_prefix(prompt(1), cache_prompt=True) == ([], 0)  # cold after the restart


def test_unwritable_folder_keeps_ram_caching(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    engine = Engine(blocker / "cache")  # mkdir fails: no disk tier writes, RAM cache as before
    tokens = prompt(1)
    engine.compute("a", tokens)
    assert engine.kv.find_cached_prefix(tokens, cache_prompt=True)[1] == 3 * BLOCK
    assert not engine.store.stats().is_writable
    engine.store.close(engine.pool)


def test_load_policy_crossover() -> None:
    policy = LoadPolicy()
    assert policy.should_load(16)  # nothing measured: load
    policy.record_prefill(1000, 1.0)  # 1 ms a token: 16 ms a block
    policy.record_load(10, 0.05)  # 5 ms a block
    assert policy.should_load(16)
    slow = LoadPolicy()
    slow.record_prefill(1000, 0.01)  # 10 us a token: 160 us a block
    slow.record_load(10, 0.05)
    assert not slow.should_load(16)


def test_kv_identity_names_everything_that_makes_kv_differ(tmp_path: Path, smollm2_path: Path) -> None:
    from mlxcel.loading import LoadedModel, open_checkpoint
    from mlxcel.serving.served_model import RuntimeOptions, kv_identity, load_tokenizer

    checkpoint = open_checkpoint(smollm2_path)
    tokenizer = load_tokenizer(checkpoint)

    def identity(path: Path = smollm2_path, config: dict | None = None, **options: object) -> str:
        loaded = LoadedModel(torch.nn.Module(), config or checkpoint.config, path, checkpoint.gguf, None)
        return kv_identity(loaded, tokenizer, RuntimeOptions(**options))  # type: ignore[arg-type]

    base = identity()
    assert identity() == base  # the same files and settings: the same folder after a restart
    other_file = tmp_path / smollm2_path.name
    other_file.write_bytes(b"GGUF" + bytes(1000))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    projector = tmp_path / "mmproj.gguf"  # issue 43: image blocks' KV comes from the projector's tower
    projector.write_bytes(b"GGUF" + bytes(100))
    rope = {**checkpoint.config, "rope_theta": float(checkpoint.config.get("rope_theta", 10000.0)) * 2}
    others = [identity(other_file), identity(config=rope), identity(quantize="off"),
              identity(adapters=((adapter, 1.0),)), identity(mmproj=projector)]
    assert len({base, *others}) == 6



def test_issue41_sidecars_are_written_with_their_blocks_counted_and_evicted_with_them(tmp_path: Path) -> None:
    """A block's sidecar (a hybrid's state snapshot) is written with it, counts in the capacity, and goes when
    the capacity evicts its block; one written alone (its snapshot left RAM first) is counted too."""
    from safetensors.torch import load_file

    probe = Engine(tmp_path / "probe")
    probe.compute("a", prompt(1))
    probe.store.close(probe.pool)
    file_size = next(probe.store.folder.glob("*.kvb")).stat().st_size
    engine = Engine(tmp_path / "bounded", capacity=6 * file_size)
    engine.store.sidecar = lambda block_hash: {"state": torch.full((256,), float(block_hash % 7))}
    alone = 12345
    engine.store.save_sidecar(alone, {"state": torch.ones(256)})
    for seed in range(2, 8):  # 3 blocks each, 18 in all: the capacity evicts
        engine.compute(str(seed), prompt(seed))
    engine.store.close(engine.pool)
    folder = tmp_path / "bounded"
    blocks, sidecars = list(folder.glob("*/*.kvb")), list(folder.glob("*/*.rstate"))
    assert blocks and {p.stem for p in sidecars} - {f"{alone:064x}"} <= {p.stem for p in blocks}
    assert {p.stem for p in blocks} <= {p.stem for p in sidecars}  # every block kept its sidecar
    for path in sidecars:
        expected = 1.0 if path.stem == f"{alone:064x}" else float(int(path.stem, 16) % 7)
        assert torch.equal(load_file(str(path))["state"], torch.full((256,), expected))
    total = sum(p.stat().st_size for p in [*blocks, *sidecars])
    assert total <= 6 * file_size and engine.store.stats().size_bytes == total
