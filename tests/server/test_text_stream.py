"""TextStream: stop strings split across tokens, held-back tails, incomplete UTF-8 (no server needed)."""
from __future__ import annotations

from kie_moe.scheduler import TextStream

PIECES = {1: "xa", 2: "b", 3: "c", 4: "bd", 5: "hello ", 6: "\x00", 7: "\x01", 8: "END"}


class FakeTok:
    """decode = concatenation, except that 6 then 7 form one character (like the two bytes of a UTF-8 'é')
    and either alone decodes to U+FFFD."""

    def decode(self, ids):
        s = "".join(PIECES[i] for i in ids)
        return s.replace("\x00\x01", "é").replace("\x00", "\ufffd").replace("\x01", "\ufffd")


def run(ids, stop):
    ts, out = TextStream(FakeTok(), tuple(stop)), []
    for t in ids:
        delta, hit = ts.push(t)
        out.append(delta)
        if hit:
            return out, True
    out.append(ts.flush())
    return out, False


def test_no_stop_streams_everything():
    assert run([5, 1, 2], ()) == (["hello ", "xa", "b", ""], False)


def test_stop_split_across_tokens_is_held_back_then_cut():
    out, hit = run([5, 1, 2, 3, 5], ["abc"])
    assert hit and "".join(out) == "hello x" and out[:2] == ["hello ", "x"]


def test_partial_match_that_diverges_is_released():
    out, hit = run([1, 4, 5], ["abc"])
    assert not hit and "".join(out) == "xabdhello " and out[0] == "x"


def test_earliest_of_several_stops_wins():
    out, hit = run([5, 1, 2, 3], ["bc", "lo", "zzz"])
    assert hit and "".join(out) == "hel"


def test_held_tail_is_flushed_at_the_end():
    out, hit = run([5, 1], ["abc"])
    assert not hit and out == ["hello ", "x", "a"]


def test_incomplete_utf8_waits_for_its_next_byte():
    out, hit = run([5, 6, 7, 8], ())
    assert out == ["hello ", "", "é", "END", ""]
    # and a dangling fragment at the very end is still sent (as U+FFFD) rather than dropped
    assert run([5, 6], ()) == (["hello ", "", "\ufffd"], False)


def test_stop_inside_one_token_and_without_tokenizer():
    out, hit = run([8], ["N"])
    assert hit and out == ["E"]
    ts = TextStream(None, ())
    assert ts.push(3) == ("", False) and ts.flush() == ""
