"""Text in and out of token ids: the tokenizer (tokenizer.json or GGUF vocabularies), the
incremental detokenizer, stop strings, and the chat template (load, render with transformers'
semantics, or a 400; the generic tool-call polyfill for templates without tools). The chat
features built on top live in chat/."""
