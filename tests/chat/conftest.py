"""The chat-feature tests use the text layer's tiny hand-built vocabularies; the real models' tokenizers
(`smollm2_tokenizer`, `gemma3_tokenizer`, ...) are the root conftest's session fixtures, shared with tests/text."""

from tests.text.conftest import byte_level_tokenizer, sentencepiece_tokenizer  # noqa: F401 - shared with tests/text
