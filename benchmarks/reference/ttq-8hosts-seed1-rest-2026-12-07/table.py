"""Seed 1 at 8 hosts for qsgd and global_qsgd_exp (run.sh), beside the seed-1 rows of
../ttq-8hosts-seed1-2026-12-07/ (fp32, global_qsgd, fp16) and the seed-0 rows of
../ttq-8hosts-defaults-2026-12-07/, by the table of ../ttq-8hosts-seed1-2026-12-07/table.py
(see there how the times are set).

    python benchmarks/reference/ttq-8hosts-seed1-rest-2026-12-07/table.py   # from the repository's root

Both methods' curves are on loopback (loss/), their first 25 steps timed on the cluster
(8x1-1gbit/), between two 25-step anchors of Horovod fp32 (anchor-before/, anchor-after/).
fp32's seed-1 curve is the first folder's (copied into loss/ for the timing's check)."""
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "ttq_8hosts_seed1_table", HERE.parent / "ttq-8hosts-seed1-2026-12-07" / "table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

SEED0 = "ttq-8hosts-defaults-2026-12-07/loss"
ROWS = {("horovod_fp32", 0): ("ttq-8hosts-2026-12-03", "8x1-1gbit"),
        ("horovod_fp32", 1): table.ROWS[("horovod_fp32", 1)],
        **{(name, seed): (SEED0 if seed == 0 else HERE.name + "/loss", "8x1-loopback")
           for name in ("global_qsgd", "qsgd", "global_qsgd_exp") for seed in (0, 1)}}
ROWS[("global_qsgd", 1)] = table.ROWS[("global_qsgd", 1)]
TIMED = {name: (HERE, (HERE / "anchor-before", HERE / "anchor-after")) for name in ("qsgd", "global_qsgd_exp")}

if __name__ == "__main__":
    table.main(ROWS, TIMED)
