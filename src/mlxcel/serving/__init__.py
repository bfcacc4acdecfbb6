"""What builds the serving process, grouped by the process each module runs in (issue 25).

API process (the one `mlxcel serve` starts; HTTP, templates, detokenization), assembled by
`mlxcel.startup` (settings -> process plan -> side models -> chat model -> `ServerState`, A6):
  `side_models`  the process plan (spec I) and the embedding, rerank, image and Florence-2 workers
  `audio_models` an audio-only or realtime process's Whisper and voice (specs G, H)
  `process`      their products as plain data, which `server/` holds without importing a loader
  `chat_model`   the chat model's tokenizer and template here, its engine on a thread here or in
                 the engine process
Either process:
  `served_model` `RuntimeOptions`, `ServedModel` and `build_served`: weights, decode path,
                 drafter, `EngineCore`, warmup
The line between them:
  `engine_process` `start_engine_process` (API side: spawn, wait) and `engine_process_main`, the
                 engine child's entry point (`--engine-process on`, or auto with a GPU)

The package is one layer below `server/` and `command_line` (tests/server/test_layering.py judges
packages as wholes): nothing here imports them; `mlxcel.startup`, above all three, puts the process
together. This file imports nothing.
"""
