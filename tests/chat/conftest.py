"""The chat-feature tests use the text layer's tokenizers (real model files, tiny hand-built vocabularies)."""

from tests.text.conftest import (  # noqa: F401 - fixtures shared with tests/text
    byte_level_tokenizer, gemma3_metadata, gemma3_reference, gemma3_tokenizer, sentencepiece_tokenizer,
    smollm2_metadata, smollm2_reference, smollm2_tokenizer,
)
