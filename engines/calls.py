"""One checker for TensorRT API calls: every failure becomes an ``EngineError`` naming the call.

TensorRT's Python bindings fail in three ways, depending on the call and the
version: they raise (``RuntimeError``, ``TypeError``, ``ValueError`` from
pybind11; full TensorRT's ``set_optimization_profile_async`` raises where
TensorRT-RTX returns False), return ``False``, or return ``None`` where an
object was due (``create_execution_context``). ``trt_call`` turns each into
one typed error that says where (the engine and run graph), which call, with
what arguments, and TensorRT's words.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash_trt.errors import EngineError


def trt_call(where: str, call: str, method: Callable, *args, none_fails: bool = False, false_fails: bool = True):
    """``method(*args)``; raise ``EngineError`` on an exception, on ``False`` (unless the call
    answers a question: ``false_fails=False``), and (``none_fails``) on ``None``.

    ``where`` names the object (e.g. "engine 'target_model' (target_verify_2)"),
    ``call`` the API (e.g. "set_optimization_profile_async").
    """
    shown = ", ".join(_show(a) for a in args)
    try:
        result = method(*args)
    except Exception as error:  # the bindings raise whatever pybind11 maps TensorRT's failure to
        msg = f"{where}: TensorRT {call}({shown}) raised {type(error).__name__}: {error}"
        raise EngineError(msg) from error
    if (false_fails and result is False) or (none_fails and result is None):
        msg = f"{where}: TensorRT {call}({shown}) failed (returned {result}; TensorRT's log says why)"
        raise EngineError(msg)
    return result


def _show(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 1 << 32:
        return hex(value)  # a device address or stream handle
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
