"""Run several example scripts, one after another, in one horovodrun job.

    horovodrun -np 2 ... python tests/mp/examples_worker.py OUT_DIR CASES_JSON

``CASES_JSON`` is a list of ``[label, script, [args...]]``. Each case runs the script as
``python script args`` would (``runpy``, as ``__main__``, ``sys.argv`` set) in these same
processes, so a job pays the interpreter's, the frameworks' and Horovod's start-up once for
many cases instead of once per case. Rank 0 writes each case's standard output to
``OUT_DIR/<label>.out`` and its outcome (``ok``, the error) to ``OUT_DIR/<label>.status``;
a failing case does not stop the others. Between cases, Keras' global state (the
mixed-precision policy, the session) is reset, as a fresh process would have it.
"""

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


def reset_keras():
    if "keras" in sys.modules:
        keras = sys.modules["keras"]
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()


def main():
    out_dir, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    import horovod.common.basics  # noqa: F401  (the examples import their framework's Horovod)

    for label, script, args in cases:
        buffer = io.StringIO()
        status = {"ok": True}
        sys.argv = [script, *map(str, args)]
        sys.path.insert(0, str(Path(script).parent))  # the examples import their common.py
        try:
            with contextlib.redirect_stdout(buffer):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # argparse, or an example's own exit
            if exc.code not in (None, 0):
                status = {"ok": False, "error": f"SystemExit({exc.code!r})"}
        except BaseException:
            status = {"ok": False, "error": traceback.format_exc()}
        finally:
            sys.path.pop(0)
            reset_keras()
        rank = _rank()
        if rank == 0:
            (out_dir / f"{label}.out").write_text(buffer.getvalue())
            (out_dir / f"{label}.status").write_text(json.dumps(status))
        elif not status["ok"]:
            print(f"rank {rank}: case {label} failed: {status['error']}", file=sys.stderr, flush=True)


def _rank():
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            return module.rank()
    return 0


if __name__ == "__main__":
    main()
