"""The chat features end to end (spec S, R, Q, P, V), fed one typed `ChatOptions` per request.

Owns prompt planning (`plan.py`: template kwargs, reasoning echo, stale-thinking strip), reasoning
(`reasoning.py` parse, `budget.py`, `reasoning_echo.py`), tool-call formats (`tools/`, with the
streaming JSON reader), structured output (`grammar.py`, llguidance), the loop guard
(`loop_guard.py`) and the output events (`events.py`, `output.py`, `completion_output.py`).
It never sees a request body or a protocol's field names: each adapter in `api/` fills a
`ChatOptions`. The engine knows its token processors only as `types.TokenProcessor`.
"""
