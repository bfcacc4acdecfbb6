"""The KV subsystem: what holds a step's keys and values, and which request owns which of them.

- `blocks.py`: `BlockPool`, fixed-size blocks handed out by id with ref counts, one LRU free
  queue and the hash index of cached blocks (pure Python, no tensors);
- `prefix.py`: `KVCacheManager`, per-request block tables over the pool with automatic prefix
  caching (chain hashes of full blocks, spec A3, M, N);
- `tensors.py`: `KVCache`, the key and value tensors of every layer indexed by cache slot
  (`block_id * block_size + offset`), in the element formats of layers/kv_quant.py;
- `slot_files.py`: a slot's cached prefix saved to a file and restored into the prefix cache (F12).
"""
