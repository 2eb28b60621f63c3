#!/usr/bin/env python3
"""Compile every Triton kernel of hvd_quant.kernels.gpu for a Hopper GPU (sm_90), without
a GPU, and check the PTX for what would break bit-identity with the CPU kernels.

Every variant the library launches is compiled: ``gpu.warm_up`` calls every primitive
with each of its flags and with numbers and one-element tensors as scalars, here on CPU
tensors, with the launch replaced by an ahead-of-time compilation (Triton compiles for a
named target with its bundled ptxas; no driver is needed). The PTX must hold

* no ``fma`` (a contracted multiply-add rounds once where the CPU kernel rounds twice),
* no ``.ftz`` (flushed subnormals),
* no approximate division, square root, reciprocal or exponential,

and the kernels that divide or take a square root must use ``div.rn.f32`` /
``sqrt.rn.f32``. As a control, one kernel is also compiled with FMA contraction allowed:
its PTX must then hold ``fma`` (else this check would prove nothing).

    .venv/bin/python scripts/check_ptx.py      # one line per variant; exit status 1 on a failure
"""

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORBIDDEN = {
    "a fused multiply-add": r"\bfma\.",
    "a flush-to-zero operation": r"\.ftz\b",
    "an approximate division": r"\bdiv\.(approx|full)\.",
    "an approximate operation": r"\b(sqrt|rcp|rsqrt|ex2|lg2|sin|cos)\.approx\.",
}
DIVIDES = {"_quantize_lanes_k", "_quantize_ints_k", "_quantize_lanes_blocks_k", "_quantize_ints_blocks_k",
           "_exp_encode_k", "_binsgdm_k", "_descend_k",
           "_adam_descend_k", "_zero_one_sync_input_k", "_zero_one_sync_result_k"}
ROOTS = {"_adam_descend_k", "_precondition_k", "_zero_one_sync_input_k", "_zero_one_sync_result_k"}


def compile_all(capability=90, only=None):
    """``{(kernel name, signature, constants): PTX}`` for every launch of ``gpu.warm_up``
    (of the kernels named in ``only``, if given), and the control's PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from hvd_quant.kernels import gpu

    target = GPUTarget("cuda", capability, 32)
    found = {}

    def compile_launch(kernel, programs, *args, num_warps=gpu._WARPS, **constants):
        if not programs or (only and kernel.fn.__name__ not in only):
            return
        constants = dict(constants, ASM=True)
        values = dict(zip(kernel.arg_names, args))
        signature = {name: "constexpr" if name in constants else mangle_type(values[name])
                     for name in kernel.arg_names}
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constants.items())))
        if key not in found:
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=target,
                                      options={"num_warps": num_warps, "enable_fp_fusion": False})
            found[key] = compiled.asm["ptx"]

    launch = gpu._launch
    gpu._launch = compile_launch
    try:
        gpu.warm_up("cpu")
    finally:
        gpu._launch = launch
    control = ASTSource(gpu._ema_k, {"avg": "*fp32", "value": "*fp32", "out": "*fp32", "n": "i32", "beta": "fp32",
                                     "rest": "fp32", "BETA": "constexpr", "SQUARE": "constexpr",
                                     "BLOCK": "constexpr", "ASM": "constexpr"},
                        {"BETA": False, "SQUARE": False, "BLOCK": gpu.BLOCK, "ASM": True})
    fused = triton.compile(control, target=target, options={"enable_fp_fusion": True}).asm["ptx"]
    return found, fused


def problems(name, ptx):
    out = [what for what, pattern in FORBIDDEN.items() if re.search(pattern, ptx)]
    if name in DIVIDES and "div.rn.f32" not in ptx:
        out.append("no div.rn.f32")
    if name in ROOTS and "sqrt.rn.f32" not in ptx:
        out.append("no sqrt.rn.f32")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capability", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: every kernel)")
    args = parser.parse_args()
    start = time.perf_counter()
    found, fused = compile_all(args.capability, {n for n in args.only.split(",") if n})
    failed = 0
    for (name, signature, constants), ptx in sorted(found.items()):
        bad = problems(name, ptx)
        failed += bool(bad)
        flags = ", ".join(f"{k}={v}" for k, v in constants if k != "ASM")
        print(f"{'FAIL' if bad else 'ok  '} {name}({flags}){': ' + '; '.join(bad) if bad else ''}")
    if not re.search(FORBIDDEN["a fused multiply-add"], fused):
        print("FAIL control: with FMA contraction allowed the PTX holds no fma, so its absence proves nothing")
        failed += 1
    print(f"{len(found)} kernel variants compiled for sm_{args.capability} in {time.perf_counter() - start:.0f} s; "
          f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
