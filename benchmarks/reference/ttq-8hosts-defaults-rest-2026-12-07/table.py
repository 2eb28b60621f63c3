"""The 8-host rows of this folder (run.sh) against Horovod fp32 of 2026-12-03, whose curve
these runs did not repeat (fp32's sums at 8 ranks: ../ttq-8hosts-2026-12-03/), and beside the
same methods' rows of before (two 25 MB buckets; the folders in BEFORE), by the table of
../ttq-8hosts-defaults-2026-12-07/table.py (see there how the times are set).

    python benchmarks/reference/ttq-8hosts-defaults-rest-2026-12-07/table.py   # from the repository's root

`marsit`, `onebit`, `cascading_sign` and `ef_sign` were timed for their first 25 steps on the
cluster; `auto` and `fp16` ran whole there (whole/)."""
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "ttq_8hosts_defaults_table", HERE.parent / "ttq-8hosts-defaults-2026-12-07" / "table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

#: Each method's 8-rank curve of before (two 25 MB buckets): (folder, the setting it ran in).
BEFORE = {"marsit": ("ttq-8hosts-rest-2026-12-03/loss", "8x1-loopback"),
          "cascading_sign": ("ttq-8hosts-rest-2026-12-03/loss", "8x1-loopback"),
          "ef_sign": ("ttq-8hosts-rest-2026-12-03/loss", "8x1-loopback"),
          "onebit": ("ttq-8hosts-ddp-auto-onebit-2026-12-04/loss", "8x1-loopback"),
          "auto": ("ttq-8hosts-ddp-auto-onebit-2026-12-04", "8x1-1gbit"),
          "fp16": ("ttq-8hosts-rest-2026-12-03", "8x1-1gbit")}

if __name__ == "__main__":
    table.main(HERE, BEFORE, "ttq-8x1-1gbit-defaults-rest-with-fp32.png")
