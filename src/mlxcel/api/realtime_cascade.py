"""The realtime engine served here (spec H): a cascade of four real models.

Voice activity detection (Silero, as shipped with faster-whisper) finds the end of a spoken
turn; Whisper transcribes it; the served chat model answers, streamed token by token; each
finished sentence of the answer is spoken by the speech provider while the next is generated.
Each stage runs where it always runs: Whisper and the voice on their worker threads (their
queues and deadlines apply), the chat model on the engine thread.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from mlxcel.api.context import ApiContext
from mlxcel.api.generation import Generation, GenerationParams, Prompt
from mlxcel.api.realtime import SAMPLE_RATE, AudioDelta, EngineEvent, InputTranscript, TextDelta, Turn
from mlxcel.types import SamplingParams
from mlxcel.workers.audio_io import WHISPER_SAMPLE_RATE, to_int16
from mlxcel.workers.speech import SpeechJob, SpeechSynthesizer
from mlxcel.workers.whisper import TranscriptionJob, WhisperTranscriber

DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly, in one or two short sentences."
DEFAULT_MAX_TOKENS = 120
_SENTENCE_END = re.compile(r"[.!?。！？](?=\s)|\n")


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Linear resampling of mono float32 audio (speech bands only; enough for Whisper and playback)."""
    if from_rate == to_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    num_out = int(round(samples.size * to_rate / from_rate))
    positions = np.arange(num_out) * (from_rate / to_rate)
    return np.interp(positions, np.arange(samples.size), samples).astype(np.float32)


def split_spoken(text: str) -> tuple[list[str], str]:
    """Complete sentences of `text`, and the unfinished rest."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        piece = text[start:match.end()].strip()
        if piece:
            sentences.append(piece)
        start = match.end()
    return sentences, text[start:]


@dataclass
class CascadeEngine:
    transcriber: WhisperTranscriber
    chat: ApiContext
    synthesizer: SpeechSynthesizer

    def detect_turn_end(self, audio: np.ndarray, silence_ms: int, threshold: float) -> tuple[bool, bool]:
        from faster_whisper.vad import VadOptions, get_speech_timestamps

        speech = resample(audio, SAMPLE_RATE, WHISPER_SAMPLE_RATE)
        spans = get_speech_timestamps(speech, VadOptions(threshold=threshold, min_silence_duration_ms=silence_ms,
                                                         speech_pad_ms=0))
        if not spans:
            return False, False
        trailing_silence = (speech.size - spans[-1]["end"]) / WHISPER_SAMPLE_RATE * 1000
        return True, trailing_silence >= silence_ms

    async def respond(self, turn: Turn) -> AsyncIterator[EngineEvent]:
        messages = [{"role": "system", "content": turn.instructions or DEFAULT_INSTRUCTIONS}, *turn.history]
        if turn.audio is not None:
            heard = await self._transcribe(turn.audio)
            yield InputTranscript(heard)
            messages.append({"role": "user", "content": heard})
        pending = ""
        async for piece in self._answer(messages, turn):
            yield TextDelta(piece)
            sentences, pending = split_spoken(pending + piece)
            for sentence in sentences:
                yield AudioDelta(await self._speak(sentence, turn.voice))
        if pending.strip():
            yield AudioDelta(await self._speak(pending.strip(), turn.voice))

    async def _transcribe(self, audio: np.ndarray) -> str:
        job = TranscriptionJob(resample(audio, SAMPLE_RATE, WHISPER_SAMPLE_RATE))
        return (await self.transcriber.transcribe(job)).text

    async def _answer(self, messages: list[dict[str, str]], turn: Turn) -> AsyncIterator[str]:
        template = self.chat.chat_template
        if template is None:
            raise ValueError("the chat model has no chat template; a voice session needs one")
        rendered = template.render(messages, add_generation_prompt=True)
        prompt = Prompt(tuple(self.chat.tokenizer.encode(rendered, add_special_tokens=False)), rendered)
        sampling = SamplingParams(temperature=turn.temperature, max_tokens=turn.max_output_tokens or DEFAULT_MAX_TOKENS)
        generation = Generation.start(self.chat, [prompt], GenerationParams(sampling), request_id="realtime")
        try:
            async for delta in generation.stream():
                if delta.text:
                    yield delta.text
        finally:
            await generation.aclose()

    async def _speak(self, sentence: str, voice: str) -> bytes:
        chunks: list[np.ndarray] = []
        name = self.synthesizer.resolve_voice(voice) or self.synthesizer.voice.voices[0]
        job = SpeechJob(sentence, name, 1.0, chunks.append)
        await asyncio.to_thread(self.synthesizer.run_sync, job)
        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return to_int16(resample(samples, self.synthesizer.sample_rate, SAMPLE_RATE)).tobytes()
