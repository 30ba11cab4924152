"""The remote engine's JSON codec (orjson, the standard library where orjson would differ)
says what the standard library says: the properties below hold it to ``json``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from rollout_trio import EngineProtocolError
from rollout_trio.engines._remote_http import decode_json, encode_json
from rollout_trio.engines._sglang import SGLangBackend

INT64 = st.integers(-(2**63), 2**63 - 1)


def json_values(ints: st.SearchStrategy[int], floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | ints | floats | st.text()
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=20,
    )


def canonical(value: Any) -> str:
    """The standard library's text for ``value``: equal for equal JSON values (NaN included,
    and -0.0 told from 0.0, an int from a float)."""
    return json.dumps(value, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(json_values(st.integers(), st.floats()))
@example(float("nan"))
@example([float("inf"), float("-inf")])
@example(2**64)
@example(-(2**63) - 1)
@example("\ud800")
@example({"stop": ["é", "\x00", "\u2028"]})
def test_encode_json_says_what_the_standard_library_says(value: Any) -> None:
    """Invariant: for any JSON value (ints of any size, NaN and infinities, lone
    surrogates included), the bytes encode_json sends read back, with json.loads, as the
    same value json.dumps's text reads back as."""
    data = encode_json(value)
    assert isinstance(data, bytes)
    assert canonical(json.loads(data.decode())) == canonical(json.loads(canonical(value)))


@settings(max_examples=300, deadline=None)
@given(json_values(INT64, st.floats()), st.booleans())
@example(float("nan"), True)
@example([1e308, -0.0, 5e-324], True)
@example("\ud800", True)
@example({"a": 1, "b": ["é"]}, False)
def test_decode_json_reads_what_the_standard_library_reads(value: Any, ensure_ascii: bool) -> None:
    """Invariant: for any JSON text the standard library writes (NaN, Infinity and escaped
    lone surrogates included) whose integers fit in 64 bits, decode_json reads the same
    value as json.loads."""
    text = json.dumps(value, ensure_ascii=ensure_ascii)
    try:
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate written raw: no UTF-8 body can hold it
        assume(False)
    assert canonical(decode_json(data)) == canonical(json.loads(text))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)))
@example(b"")
@example(b"\xff")
@example(b'{"a": 1,}')
@example(b"1e400")
@example(b"[NaN, -Infinity]")
@example(b'"\\udc00"')
def test_decode_json_fails_where_the_standard_library_fails(data: bytes) -> None:
    """Invariant: on any bytes (valid UTF-8 JSON or not) without a 19-digit run (integers
    beyond 64 bits), decode_json raises ValueError exactly when json.loads of the decoded
    text does, and otherwise reads the same value."""
    assume(not any(data[i : i + 19].isdigit() for i in range(len(data))))
    try:
        expected = canonical(json.loads(data.decode()))
    except ValueError:  # UnicodeDecodeError included
        with pytest.raises(ValueError):
            decode_json(data)
        return
    assert canonical(decode_json(data)) == expected


def test_integers_beyond_64_bits_are_rejected_where_a_token_id_is_expected() -> None:
    """orjson reads an integer beyond 64 bits as a float (json: an int): an SGLang answer
    with such a token id is an EngineProtocolError naming the entry, never a token."""
    value = decode_json(b"[18446744073709551616]")[0]
    assert value == 2**64 or (isinstance(value, float) and value == float(2**64))
    body = decode_json(
        b'{"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 18446744073709551616]]}}'
    )
    if isinstance(body["meta_info"]["output_token_logprobs"][0][1], float):
        with pytest.raises(EngineProtocolError, match=r"output_token_logprobs\[0\]\[1\]: must be a token id"):
            SGLangBackend().parse(body)


def test_a_nan_logprob_in_a_body_is_rejected_by_field_name() -> None:
    """A body orjson refuses (NaN) still reaches the validator, which names the field."""
    body = decode_json(b'{"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[NaN, 3]]}}')
    assert math.isnan(body["meta_info"]["output_token_logprobs"][0][0])
    with pytest.raises(EngineProtocolError, match=r"output_token_logprobs\[0\]\[0\]: must be a finite logprob"):
        SGLangBackend().parse(body)
