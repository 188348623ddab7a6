"""server/serving_pooling.py's request shapes and helpers: inputs to prompts, the float and
base64 encodings (OpenAI's little-endian float32), cosine, and pydantic's refusals."""

import base64
import struct

import pytest
from pydantic import ValidationError

from pagedserve.errors import InvalidRequestError
from pagedserve.server.serving_pooling import EmbeddingRequest, RerankRequest, _inputs, cosine, encode


def test_inputs_strings_and_token_ids():
    assert _inputs("hi") == ["hi"]
    assert _inputs(["a", "b"]) == ["a", "b"]
    assert _inputs([1, 2, 3]) == [{"prompt_token_ids": [1, 2, 3]}]
    assert _inputs([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    with pytest.raises(InvalidRequestError) as e:
        _inputs([])
    assert e.value.param == "input"


def test_encode_base64_is_little_endian_float32():
    vec = [0.5, -1.25, 3.0]
    assert encode(vec, "float") == vec
    raw = base64.b64decode(encode(vec, "base64"))
    assert list(struct.unpack("<3f", raw)) == vec


def test_cosine():
    assert cosine([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 2.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)


def test_request_models_refuse_unknown_fields_and_bad_values():
    with pytest.raises(ValidationError):
        EmbeddingRequest(input="x", bogus=1)
    with pytest.raises(ValidationError):
        EmbeddingRequest(input="x", dimensions=0)
    with pytest.raises(ValidationError):
        RerankRequest(query="q", documents=["d"], top_n=0)
