"""Stop strings over a token stream: matched across token boundaries, never leaked."""

from __future__ import annotations

from rewind.engine.stops import StopStringFilter, TextStream


def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None, str]:
    """Released text per piece, the stop that matched, and what flush gives at the end."""
    stop_filter = StopStringFilter(stops)
    released = []
    for piece in pieces:
        step = stop_filter.feed(piece)
        released.append(step.text)
        if step.stop is not None:
            return released, step.stop, ""
    return released, None, stop_filter.flush()


def test_stop_split_over_three_pieces_is_caught_and_never_released():
    released, stop, _ = feed_all(["<|end|>"], ["Hello <", "|en", "d|> tail"])
    assert stop == "<|end|>"
    assert "".join(released) == "Hello "
    assert released == ["Hello ", "", ""]  # "<" and "<|en" were held back


def test_a_false_start_is_released_once_it_cannot_match():
    released, stop, rest = feed_all(["STOP"], ["ST", "OX", " ok S"])
    assert stop is None
    assert released == ["", "STOX", " ok "]
    assert rest == "S"  # still a possible start: released only by flush


def test_the_earliest_of_several_stops_wins():
    released, stop, _ = feed_all(["world", "lo w"], ["hel", "lo world"])
    assert stop == "lo w"
    assert "".join(released) == "hel"


def test_no_stops_releases_everything_at_once():
    released, stop, rest = feed_all([], ["a", "bc"])
    assert released == ["a", "bc"] and stop is None and rest == ""


def test_stop_inside_one_piece_cuts_the_piece():
    released, stop, _ = feed_all(["\n\n"], ["one\n\ntwo"])
    assert released == ["one"] and stop == "\n\n"


def test_text_stream_over_real_tokens(tiny_loaded):
    tokenizer = tiny_loaded("llama").tokenizer
    text = "The weather in Berlin is cloudy with light rain"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, stops=["cloudy with"])
    released = []
    for token in tokens:
        step = stream.add(token)
        released.append(step.text)
        if step.stop:
            break
    assert step.stop == "cloudy with"
    assert "".join(released) == "The weather in Berlin is "

    whole = TextStream(tokenizer, stops=["zzz"])
    pieces = [whole.add(t).text for t in tokens] + [whole.finish().text]
    assert "".join(pieces) == text


def test_text_stream_holds_partial_utf8_until_complete(tiny_loaded):
    tokenizer = tiny_loaded("llama").tokenizer
    text = "café ☕ done"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, stops=[])
    pieces = [stream.add(t).text for t in tokens] + [stream.finish().text]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
