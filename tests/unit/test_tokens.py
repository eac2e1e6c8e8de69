from trainer.tokens import ASK, EOS, FIRST_CONTENT, completion_kind, content


def test_completion_kind() -> None:
    assert completion_kind([]) == "empty"
    assert completion_kind([EOS, 5]) == "empty"
    assert completion_kind([ASK, 7, EOS]) == "question"
    assert completion_kind([FIRST_CONTENT, EOS]) == "edit"


def test_content_stops_at_eos() -> None:
    assert content([5, 6, EOS, 7]) == [5, 6]
    assert content([5, 6]) == [5, 6]
