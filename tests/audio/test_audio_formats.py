"""The audio protocol's pure parts (spec G, H): form validation, subtitle formats, sentence cuts."""

from __future__ import annotations

import pytest

from mlxcel.api.audio import parse_transcription_form, to_srt, to_vtt, verbose_json
from mlxcel.api.errors import ApiError
from mlxcel.api.realtime_cascade import resample, split_spoken
from mlxcel.workers.speech import split_sentences
from mlxcel.workers.whisper import Segment, Transcript, Word

TRANSCRIPT = Transcript("transcribe", "en", 3725.5, (
    Segment(0, 0, 0.0, 1.25, " Hello there.", (1, 2), 0.0, -0.1, 1.2, 0.01, (Word(0.0, 0.5, " Hello", 0.9),)),
    Segment(1, 100, 3723.004, 3725.5, " Goodbye.", (3,), 0.2, -0.2, 1.1, 0.02),
))


def test_srt_and_vtt_timestamps_roll_over_hours() -> None:
    assert to_srt(TRANSCRIPT) == ("1\n00:00:00,000 --> 00:00:01,250\nHello there.\n\n"
                                  "2\n01:02:03,004 --> 01:02:05,500\nGoodbye.\n")
    assert to_vtt(TRANSCRIPT).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.250\nHello there.\n\n01:02:03.004")


def test_verbose_json_shape() -> None:
    body = verbose_json(TRANSCRIPT, ("word", "segment"))
    assert body["text"] == "Hello there. Goodbye." and body["language"] == "english"
    assert body["segments"][1]["seek"] == 100 and body["words"] == [{"word": "Hello", "start": 0.0, "end": 0.5}]
    assert "words" not in verbose_json(TRANSCRIPT, ("segment",))


@pytest.mark.parametrize("fields, message", [
    ({"response_format": ["xml"]}, "response_format must be one of"),
    ({"temperature": ["hot"]}, "temperature must be a number"),
    ({"temperature": ["1.5"]}, "between 0 and 1"),
    ({"language": ["english"]}, "ISO-639-1"),
    ({"timestamp_granularities[]": ["word"]}, "needs response_format verbose_json"),
    ({"timestamp_granularities[]": ["char"], "response_format": ["verbose_json"]}, "'word' and/or 'segment'"),
    ({"stream": ["true"]}, "stream"),
    ({"prompt": ["a", "b"]}, "give it once"),
    ({"colour": ["red"]}, "unknown field 'colour'"),
])
def test_form_errors_name_the_field(fields: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        parse_transcription_form(fields, "transcribe")
    assert caught.value.status == 400


def test_translation_takes_no_language() -> None:
    with pytest.raises(ApiError, match="unknown field 'language'"):
        parse_transcription_form({"language": ["de"]}, "translate")
    parsed = parse_transcription_form({"response_format": ["text"], "model": ["whisper-1"]}, "translate")
    assert parsed.task == "translate" and parsed.granularities == ("segment",)


def test_sentence_cuts() -> None:
    assert split_sentences("One. Two!  Three?\nFour") == ["One.", "Two!", "Three?", "Four"]
    assert split_sentences("こんにちは。元気ですか？はい") == ["こんにちは。", "元気ですか？", "はい"]
    assert split_spoken("Hello there. How are") == (["Hello there."], " How are")
    assert split_spoken("3.5 is a number") == ([], "3.5 is a number")


def test_resample_keeps_duration() -> None:
    import numpy as np

    assert resample(np.zeros(22050, np.float32), 22050, 24000).size == 24000
