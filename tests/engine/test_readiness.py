"""Pure parts of readiness: the engine's own error message, picked from its log."""

from hpcserve.engine.logs import engine_error

PYDANTIC_LOG = """INFO 11-30 starting
Traceback (most recent call last):
  File "x.py", line 1, in <module>
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (999999) is greater than the derived max_model_len
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_engine_error_keeps_the_reason_under_a_pydantic_header():
    message = engine_error(PYDANTIC_LOG)
    assert message.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig")
    assert "max_model_len (999999)" in message and "further information" not in message


def test_engine_error_last_error_line_or_last_line():
    assert engine_error("ok\nRuntimeError: CUDA out of memory\nshutting down\n") == "RuntimeError: CUDA out of memory"
    assert engine_error("usage: vllm serve\nvllm serve: error: argument --dtype: invalid choice\n").endswith("invalid choice")
    assert engine_error("") == "(the engine wrote nothing to its log)"
