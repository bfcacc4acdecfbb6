"""Side models beside the chat engine, each owned by one thread behind a bounded queue:
embedding, rerank (cross-encoder and generative), Whisper transcription and speech synthesis."""
