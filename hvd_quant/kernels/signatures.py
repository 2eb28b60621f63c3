"""What each fused primitive's kernel takes and returns, for callers that must say so ahead.

A graph framework calls a kernel through an op whose outputs (dtypes and shapes) are
declared when the graph is built, and whose inputs are tensors; the kernel's numeric
arguments (a learning rate, a random call's key) may be tensors there too, while the
kernel wants numbers. :data:`SIGNATURES` says, for every public function of
:mod:`hvd_quant.kernels.cpu`:

* ``scalars``: the parameters that take one number (a Python number, or a one-element
  tensor that the caller turns into one);
* ``outputs``: the results, in the order the function returns them, each with the keyword
  that lets the caller supply its memory (``None``: the kernel allocates it; small), its
  dtype and its number of elements (``None``: a scalar), both computed from the call's
  arguments;
* ``in_place``: the flag parameter that asks the kernel to write over an input, which a
  caller supplying every output's memory turns off.

``tests/test_tf_kernels.py`` checks the table against the kernels' real results.
"""

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

from .blocks import piece_blocks


@dataclass(frozen=True)
class Output:
    keyword: Optional[str]
    dtype: Union[str, Callable]
    numel: Optional[Callable]  # (arguments by name, numel function) -> int; None: a scalar


@dataclass(frozen=True)
class Signature:
    outputs: tuple
    scalars: tuple = ()
    in_place: Optional[str] = None


def _size(name):
    return lambda a, numel: numel(a[name])


def _bytes(name):
    return lambda a, numel: (numel(a[name]) + 7) // 8


def _segments(a, numel):
    return len(a["bounds"]) - 1


def _f32(keyword, of):
    return Output(keyword, "float32", _size(of))


def _blocks(a, numel):
    return piece_blocks(numel(a["x"]), a["block"], 0)[2]


def _lane_words(a, numel):
    lanes = 32 // int(a["width"])
    return (numel(a["x"]) + lanes - 1) // lanes


SIGNATURES = {
    "sign_pack": Signature((Output("out", "uint8", _bytes("x")),)),
    "sign_pack_residual": Signature((Output("bits_out", "uint8", _bytes("x")), _f32("out", "x"))),
    "unpack_scaled_sum": Signature((Output("out", "float32", lambda a, numel: int(a["d"])),)),
    "compensate_sums": Signature((Output(None, "float64", _segments),)),
    "compensate_sums_signs": Signature((Output(None, "float64", _segments),
                                        Output("bits_out", "uint8", _bytes("x")))),
    "sign_residual": Signature((_f32("out", "x"),)),
    "unpack_sums_signs": Signature((Output("out", "float32", lambda a, numel: int(a["d"])),
                                    Output(None, "float64", _segments),
                                    Output("bits_out", "uint8", lambda a, numel: (int(a["d"]) + 7) // 8))),
    "unpack_sum_residual": Signature((Output("out", "float32", lambda a, numel: int(a["d"])),
                                      _f32("resid_out", "x"))),
    "absmax_finite": Signature((Output(None, "float32", None), Output(None, "bool", None))),
    "quantize_lanes": Signature((Output("out", "int32", _lane_words),), scalars=("pre", "scale", "key")),
    "quantize_ints": Signature((Output("out", lambda a: str(a["dtype"]), _size("x")),),
                               scalars=("pre", "scale", "key")),
    "dequantize_lanes": Signature((Output("out", "float32", lambda a, numel: int(a["numel"])),),
                                  scalars=("factor",)),
    "dequantize_ints": Signature((_f32("out", "q"),), scalars=("factor",)),
    "block_absmax_finite": Signature((Output(None, "float32", _blocks), Output(None, "bool", None))),
    "quantize_lanes_blocks": Signature((Output("out", "int32", _lane_words),), scalars=("key",)),
    "quantize_ints_blocks": Signature((Output("out", lambda a: str(a["dtype"]), _size("x")),), scalars=("key",)),
    "dequantize_lanes_blocks": Signature((Output("out", "float32", lambda a, numel: int(a["numel"])),)),
    "dequantize_ints_blocks": Signature((_f32("out", "q"),)),
    "exp_encode": Signature((Output("out", "uint8", _size("x")),), scalars=("scale", "key")),
    "exp_combine": Signature((Output("out", "uint8", _size("a")),), scalars=("key",)),
    "exp_decode": Signature((_f32("out", "codes"),), scalars=("factor", "scale")),
    "marsit_select": Signature((Output("out", "uint8", _size("own")),), scalars=("keep", "key")),
    "rebinarize": Signature((Output("out", "uint8", lambda a, numel: numel(a["rows"]) // int(a["k"])),),
                            scalars=("k", "key")),
    "binsgdm_encode": Signature((_f32("m_out", "g"), _f32("b_out", "g"), Output("bits_out", "uint8", _bytes("g"))),
                                scalars=("beta", "key")),
    "uniform": Signature((Output("out", "float32", lambda a, numel: int(a["n"])),), scalars=("key",)),
    "random_bytes": Signature((Output("out", "uint8", lambda a, numel: int(a["n"])),), scalars=("key",)),
    "all_finite": Signature((Output(None, "bool", None),)),
    "ema": Signature((_f32("out", "avg"),), scalars=("beta",), in_place="in_place"),
    "descend": Signature((_f32("out", "x"),), scalars=("lr", "weight_decay", "divisor"), in_place="in_place"),
    "adam_descend": Signature((_f32("x_out", "x"),
                               Output("acc_out", "float32",
                                      lambda a, numel: numel(a["x"]) if a["acc"] is not None else 0)),
                              scalars=("lr", "eps", "weight_decay")),
    "precondition": Signature((_f32("out", "u"),), scalars=("eps",)),
    "zero_one_sync_input": Signature((_f32("base", "x"), _f32("w", "x")),
                                     scalars=("beta", "lr", "eps", "weight_decay")),
    "zero_one_sync_result": Signature((_f32("synced", "w"), _f32("momentum", "w")), scalars=("eps", "lrs")),
}


def bind(fn, args, kwargs):
    """The call's arguments by parameter name, defaults included (an ordered dict)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def output_dtype(output, arguments):
    return output.dtype(arguments) if callable(output.dtype) else output.dtype
