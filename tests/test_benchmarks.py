"""The speed benchmarks (issue 7) run and report what they claim.

``benchmarks/bench_cluster.py`` (side-by-side methods on an emulated cluster) and
``benchmarks/bench_quantize.py`` (every fused kernel against ``clone()``) are what the
README's speed figures come from. These tests do not time anything (timings on a shared
CI machine prove nothing): they check the bookkeeping (medians over the slowest rank,
speed-ups, the roofline's link and memory terms, PowerSGD's byte model) on made-up raw
results, and run both benchmarks end to end on small buffers, checking that every
requested method produced a time, that the wire meter's bytes are what each method must
send, and that the table, the JSON and the plot are written.
"""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_cluster  # noqa: E402


def raw_result(case="buffer", copy_s=0.01, numel=1000, methods=None):
    """A worker's raw result: ``methods`` maps a name to (times per rank per repeat,
    bytes sent, bytes touched)."""
    return {"config": {"case": case, "ranks": 2, "numel": numel, "repeats": 3, "batch": 4},
            "copy_s": [[copy_s] * 3, [copy_s] * 3], "copy_bytes": 4 * numel,
            "methods": {name: {"times_s": times, "sent_bytes": sent, "touched_bytes": touched, "kinds": []}
                        for name, (times, sent, touched) in (methods or {}).items()},
            "skipped": []}


def test_summary_uses_the_slowest_rank_and_the_roofline_terms():
    raw = raw_result(methods={
        "horovod_fp32": ([[1.0, 3.0, 2.0], [1.5, 2.0, 2.5]], 1e6, 8e3),
        "ef_sign": ([[0.2, 0.1, 0.3], [0.1, 0.4, 0.1]], 1e3, 24e3),
        "ddp_powersgd": ([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], 2e4, 32e3),
    })
    s = bench_cluster.summarize(raw, rate_bps=1e9)
    # copy bandwidth: read + write of 4000 bytes in 10 ms
    assert s["copy_gbps"] == pytest.approx(2 * 4000 / 0.01 / 1e9)
    fp32, ef = s["methods"]["horovod_fp32"], s["methods"]["ef_sign"]
    assert fp32["median_s"] == pytest.approx(2.5)  # slowest rank per repeat: 1.5, 3.0, 2.5
    assert ef["median_s"] == pytest.approx(0.3)    # 0.2, 0.4, 0.3
    assert ef["speedup_vs_horovod_fp32"] == pytest.approx(2.5 / 0.3)
    assert ef["speedup_vs_ddp_powersgd"] == pytest.approx(0.5 / 0.3)
    assert ef["link_s"] == pytest.approx(1e3 * 8 / 1e9)
    assert ef["memory_s"] == pytest.approx(24e3 / (2 * 4000 / 0.01))
    assert ef["roofline_s"] == pytest.approx(ef["link_s"] + ef["memory_s"])
    assert ef["pct_of_roofline"] == pytest.approx(100 * ef["roofline_s"] / 0.3)
    table = bench_cluster.markdown_table({"summary": s, "raw": raw, "rate": "1gbit", "hosts": 2,
                                          "slots": 1, "case": "buffer"})
    assert "| ef_sign | 300.0 | 8.33x | 1.67x |" in table
    assert "skipped" not in table
    # A timed step that an optimizer skipped (not finite) did less work: the row says so.
    raw["methods"]["ef_sign"]["skipped_steps"] = 2
    table = bench_cluster.markdown_table({"summary": bench_cluster.summarize(raw, rate_bps=1e9), "raw": raw,
                                          "rate": "1gbit", "hosts": 2, "slots": 1, "case": "buffer"})
    assert "| ef_sign **2 timed step(s) skipped, not finite** | 300.0 |" in table


def test_paired_baseline_floor_and_share_of_the_ideal():
    """Each method is compared with the baseline and floor timed interleaved with it; the
    ideal is its paired floor plus its own wire time; % of ideal is the saving reached."""
    raw = raw_result(case="model", methods={
        "horovod_fp32": ([[2.0] * 3, [2.0] * 3], 1e8, 0.0),
        "local": ([[0.5] * 3, [0.5] * 3], 0.0, 0.0),
        "ef_sign": ([[0.8] * 3, [0.9] * 3], 1e6, 0.0),
    })
    raw["methods"]["ef_sign"]["paired_s"] = {"horovod_fp32": [[2.4] * 3, [2.5] * 3],
                                             "local": [[0.6] * 3, [0.7] * 3]}
    s = bench_cluster.summarize(raw, rate_bps=1e8)
    ef = s["methods"]["ef_sign"]
    assert ef["baseline_s"] == pytest.approx(2.5) and ef["floor_s"] == pytest.approx(0.7)
    assert ef["speedup_vs_horovod_fp32"] == pytest.approx(2.5 / 0.9)
    assert ef["ideal_s"] == pytest.approx(0.7 + 1e6 * 8 / 1e8)
    assert ef["pct_of_ideal"] == pytest.approx(100 * (2.5 - 0.9) / (2.5 - 0.78))
    assert s["methods"]["horovod_fp32"]["pct_of_ideal"] is None  # the baseline itself
    table = bench_cluster.markdown_table({"summary": s, "raw": raw, "rate": "100mbit", "hosts": 2,
                                          "slots": 2, "case": "model"})
    assert "| ef_sign | 900.0 | 2.78x | – | 1.00 | 780.0 | 93% |" in table
    assert "2 hosts x 2 rank(s)" in table


def test_the_roofline_caps_a_compressors_share_of_the_ideal():
    """Model case: a compressor's memory passes come on top of the floor, so its roofline
    reaches only part of the ideal saving: the ceiling column. A 1-bit optimizer's byte
    model counts the update that replaces the floor's own, so it gets no ceiling."""
    raw = raw_result(case="model", copy_s=0.01, numel=1000, methods={
        "horovod_fp32": ([[2.0] * 3, [2.0] * 3], 1e8, 0.0),
        "local": ([[0.5] * 3, [0.5] * 3], 0.0, 0.0),
        "ef_sign": ([[0.9] * 3, [0.9] * 3], 1e6, 1.6e5),  # 0.2 s at 8e5 B/s read + written
        "binsgdm": ([[0.7] * 3, [0.7] * 3], 1e6, 1.6e5),
    })
    raw["methods"]["binsgdm"]["kinds"] = ["onebit"]
    s = bench_cluster.summarize(raw, rate_bps=1e8)
    ef = s["methods"]["ef_sign"]
    memory = 1.6e5 / (2 * 4000 / 0.01)
    assert memory == pytest.approx(0.2)
    assert ef["roofline_s"] == pytest.approx(0.5 + 0.08 + memory)
    assert ef["ceiling_pct_of_ideal"] == pytest.approx(100 * (2.0 - 0.58 - memory) / (2.0 - 0.58))
    assert s["methods"]["binsgdm"]["ceiling_pct_of_ideal"] is None
    assert s["methods"]["horovod_fp32"]["ceiling_pct_of_ideal"] is None
    table = bench_cluster.markdown_table({"summary": s, "raw": raw, "rate": "100mbit", "hosts": 2,
                                          "slots": 1, "case": "model"})
    assert "roofline's % of ideal |" in table
    assert f"| {ef['ceiling_pct_of_ideal']:.0f}% |" in table.split("| ef_sign |")[1].splitlines()[0]


def test_model_roofline_adds_the_measured_compute_floor():
    raw = raw_result(case="model", methods={
        "horovod_fp32": ([[2.0] * 3, [2.0] * 3], 1e6, 0.0),
        "local": ([[0.5] * 3, [0.6] * 3], 0.0, 0.0),
    })
    s = bench_cluster.summarize(raw, rate_bps=1e8)
    assert s["compute_floor_s"] == pytest.approx(0.6)
    assert s["methods"]["horovod_fp32"]["roofline_s"] == pytest.approx(1e6 * 8 / 1e8 + 0.6)
    assert s["methods"]["local"]["pct_of_roofline"] == pytest.approx(100.0)


def test_powersgd_byte_model_follows_its_compression_rule():
    import cluster_worker

    n = 2
    ring = 2 * (n - 1) / n * 4
    # A 5000 x 5000 matrix at rank 4 sends P (5000 x 4) and Q (5000 x 4); a bias is sent whole.
    assert cluster_worker.powersgd_bytes([(5000, 5000), (5000,)], 4, n) == pytest.approx(
        ring * (2 * 5000 * 4 + 5000))
    # A matrix too small to gain 2x from rank 4 (PowerSGD's _should_compress) is sent whole.
    assert cluster_worker.powersgd_bytes([(6, 6)], 4, n) == pytest.approx(ring * 36)


@pytest.mark.multiprocess
@pytest.mark.timeout(560)
def test_cluster_benchmark_end_to_end(can_run, tmp_path):
    """2 hosts at 1 Gbit/s, 64k floats, one repeat: every requested method is timed on
    both ranks, the bytes sent are the wire meter's (1 bit per element for the sign
    methods, a quarter of fp32 for 8-bit Global-QSGD, ring allreduce for Horovod), and
    report.md, results.json and speedup.png are written."""
    numel = 65536
    methods = ["horovod_fp32", "ddp_powersgd", "ef_sign", "ef_sign+pipelined", "global_qsgd",
               "global_qsgd+pipelined", "onebit_allreduce", "marsit"]
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_cluster.py"), "--rates", "1gbit", "--hosts", "2",
         "--cases", "buffer", "--numel", str(numel), "--repeats", "1", "--methods", ",".join(methods),
         "--out-dir", str(out), "--job-timeout", "300"],
        capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failures"] == []
    (run,) = results["runs"]
    rows = run["summary"]["methods"]
    assert sorted(rows) == sorted(methods)
    for name, row in rows.items():
        raw = run["raw"]["methods"][name]
        # The baseline runs once per repeat with every other method (paired); the others once.
        calls = len(methods) - 1 if name == "horovod_fp32" else 1
        assert len(raw["times_s"]) == 2 and all(len(t) == calls and min(t) > 0 for t in raw["times_s"]), name
        assert row["roofline_s"] > 0 and row["speedup_vs_horovod_fp32"] > 0, name
        if name != "horovod_fp32":
            pair = raw["paired_s"]["horovod_fp32"]  # [rank][repeat]
            assert len(pair) == 2 and all(len(t) == 1 for t in pair), name
            assert row["baseline_s"] > 0 and "pct_of_ideal" in row, name
    fp32 = numel * 4  # 2 ranks: a ring allreduce sends the buffer's size once
    assert rows["horovod_fp32"]["sent_mb"] * 1e6 == pytest.approx(fp32)
    for name in ("ef_sign", "ef_sign+pipelined"):  # signs + one scale, allgather to 1 peer
        assert rows[name]["sent_mb"] * 1e6 == pytest.approx(numel / 8 + 4)
    for name in ("global_qsgd", "global_qsgd+pipelined"):  # 8-bit lanes + the max of each 512
        assert rows[name]["sent_mb"] * 1e6 == pytest.approx(numel + 4 * numel // 512)
    assert rows["onebit_allreduce"]["sent_mb"] * 1e6 == pytest.approx(numel / 8 + 8)
    report = (out / "report.md").read_text()
    assert all(f"| {m} |" in report or f"| {m} (" in report for m in methods)
    assert (out / "speedup.png").stat().st_size > 1000

    # --resume: the job already done is reused (no new times), the outputs are rewritten.
    (out / "speedup.png").unlink()
    again = subprocess.run(
        [sys.executable, str(BENCH / "bench_cluster.py"), "--rates", "1gbit", "--hosts", "2",
         "--cases", "buffer", "--numel", str(numel), "--repeats", "1", "--methods", ",".join(methods),
         "--out-dir", str(out), "--job-timeout", "300", "--resume"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "reusing" in again.stdout + again.stderr
    (rerun,) = json.loads((out / "results.json").read_text())["runs"]
    assert rerun["raw"] == run["raw"]
    assert (out / "speedup.png").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(560)
def test_scaling_benchmark_end_to_end(can_run, tmp_path):
    """The scaling case at its smallest layout (2 hosts x 1 at 1 Gbit/s, one repeat, two
    methods): the step of the 3.7M-parameter model is timed, the host link's counters give
    the bytes per rank (at least the wire meter's: headers and Horovod's own traffic come
    on top), and the scaling table and plot are written. The model trains on stdlib text:
    after its 4 steps every replica's held-out loss is below log(8192), uniform guessing."""
    out = tmp_path / "scaling"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_cluster.py"), "--cases", "scaling", "--rates", "1gbit",
         "--layouts", "2x1", "--repeats", "1", "--methods", "horovod_fp32,marsit", "--out-dir", str(out),
         "--job-timeout", "400"],
        capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["raw"]["config"]["numel"] == 3_685_632 and run["raw"]["config"]["batch"] == 1
    data = run["raw"]["config"]["data"]
    assert data["data"] == "stdlib" and data["vocab_size"] == 8192 and data["corpus_digest"] and data["vocab_digest"]
    for name, raw in run["raw"]["methods"].items():
        loss = raw["loss"]
        assert loss["steps"] >= 4 and math.isfinite(loss["train_loss"]), (name, loss)
        assert loss["val_loss"] < math.log(8192), (name, loss)
    rows = run["summary"]["methods"]
    assert sorted(rows) == ["horovod_fp32", "local", "marsit"]
    for name in ("horovod_fp32", "marsit"):
        link = rows[name]["link_mb"]
        assert link["tx"] >= rows[name]["sent_mb"] * 0.99 and link["rx"] >= rows[name]["sent_mb"] * 0.99, name
        assert link["tx"] < rows[name]["sent_mb"] * 1.5 + 0.5, name
    assert rows["horovod_fp32"]["sent_mb"] == pytest.approx(4 * 3_685_632 / 1e6)
    report = (out / "report.md").read_text()
    assert "## Scaling" in report and "| marsit |" in report
    assert (out / "scaling.png").stat().st_size > 1000


def scaling_run(hosts, slots, rate, times):
    """A summarized scaling run: ``times`` maps a method to its seconds (both ranks)."""
    raw = raw_result(case="scaling", numel=1000, methods={
        name: ([[t] * 3, [t] * 3], 4000.0 * (i + 1), 0.0) for i, (name, t) in enumerate(times.items())})
    raw["methods"]["marsit"]["link_bytes"] = {"tx": 2.5e6, "rx": 2.4e6}
    return {"rate": bench_cluster.format_rate(rate), "rate_bps": rate, "hosts": hosts, "slots": slots,
            "case": "scaling", "raw": raw, "summary": bench_cluster.summarize(raw, rate)}


def test_scaling_tables_and_plot_by_layout(tmp_path):
    """One table per rate: every method's step time (speed-up vs the paired Horovod fp32)
    at every layout, ordered by ranks, then the bytes per rank: meter / link out / link in."""
    pytest.importorskip("matplotlib")
    runs = [scaling_run(4, 1, 1e8, {"horovod_fp32": 2.0, "local": 0.5, "marsit": 0.5}),
            scaling_run(2, 1, 1e8, {"horovod_fp32": 1.0, "local": 0.5, "marsit": 0.8}),
            scaling_run(8, 2, 1e8, {"horovod_fp32": 4.0, "local": 0.5, "marsit": 1.0})]
    text = "\n".join(bench_cluster.scaling_tables(runs))
    assert "| method | 2x1 | 4x1 | 8x2 |" in text
    assert "| marsit | 800 (1.25x) | 500 (4.00x) | 1000 (4.00x) |" in text
    assert "| horovod_fp32 | 1000 | 2000 | 4000 |" in text
    assert "| marsit | 0.01 / 2.50 / 2.40 | 0.01 / 2.50 / 2.40 | 0.01 / 2.50 / 2.40 |" in text
    assert bench_cluster.plot_scaling(runs, tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 1000
    assert bench_cluster.scaling_tables([]) == []
    assert bench_cluster.parse_layouts("2x1,8X2") == [(2, 1), (8, 2)]
    with pytest.raises(ValueError, match="HOSTSxRANKS"):
        bench_cluster.parse_layouts("8by2")


def test_resume_reuses_only_the_same_job(tmp_path):
    args = argparse.Namespace(
        repeats=3, threads=0, thp=False, numel=1000, methods="", worker_arg=[])
    raw = raw_result()
    raw["config"].update({"threads_arg": 0, "thp": False, "hosts": 2, "slots": 1, "rate_bps": 1e9,
                          "protocol": "paired"})
    path = tmp_path / "1gbit_2h1s_buffer.json"
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None  # nothing there yet
    path.write_text(json.dumps(raw))
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") == raw
    assert bench_cluster.reusable(path, args, 3, 1, 1e9, "buffer") is None  # other hosts
    assert bench_cluster.reusable(path, args, 2, 2, 1e9, "buffer") is None  # other ranks per host
    assert bench_cluster.reusable(path, args, 2, 1, 1e8, "buffer") is None  # other rate
    args.repeats = 5
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None  # other repeats
    args.repeats, args.thp = 3, True
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None  # other settings
    args.thp, args.worker_arg = False, ["--batch=8"]
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None  # other worker arguments
    args.worker_arg = []
    raw["config"]["protocol"] = None  # an older run: all methods interleaved, no pairs
    path.write_text(json.dumps(raw))
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None
    path.write_text("{not json")
    assert bench_cluster.reusable(path, args, 2, 1, 1e9, "buffer") is None


@pytest.mark.timeout(300)
def test_kernel_benchmark_covers_every_kernel(tmp_path):
    """bench_quantize.py times every fused kernel against clone() and copy_() in one run
    (a small buffer here) and writes them to JSON, with the issue's four targets."""
    from hvd_quant import kernels

    if not kernels.enabled():
        pytest.skip(kernels.why_disabled())
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_quantize.py"), "--numel", "100003",
                           "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in data["rows"]}
    assert data["clone_ms"] > 0 and data["copy_ms"] > 0
    targets = {k for k, r in rows.items() if r["target_x_clone"] is not None}
    assert targets == {"sign + pack", "unpack x scale", "Marsit hop", "Global-QSGD quantize + dequantize"}
    assert all(r["ms"] > 0 for r in rows.values())
    # Every fused primitive with a fast kernel appears in some row.
    text = " ".join(rows).lower()
    for words in ("sign + pack", "unpack", "residual", "marsit", "quantize", "exponential", "binsgdm",
                  "uniform", "finite", "adam", "0/1 adam", "re-binarisation", "random bytes"):
        assert words in text, words


@pytest.mark.full
@pytest.mark.timeout(600)
def test_gpu_benchmark_runs_under_the_interpreter(tmp_path):
    """bench_gpu.py's harness on the CPU (``--interpret``: Triton's interpreter, the tiny
    one-tensor layout): every fused primitive and two methods (the others take the same
    code) on the GPU kernels, the generic torch path and the host path, the baselines
    (PowerSGD's hook at ranks 1 and 4; CuPy's recipe measured or skipped with its
    reason), JSON and markdown written."""
    from hvd_quant import kernels
    from triton_env import triton_env

    env = triton_env()  # Triton in the benchmark's process only (tests/triton_env.py says why)
    if env is None:
        pytest.skip("Triton is not installed (scripts/bootstrap.sh --with-triton)")
    if not kernels.enabled():
        pytest.skip(kernels.why_disabled())
    out = tmp_path / "gpu"
    only = ",".join(kernels.NAMES + ("ef_sign", "global_qsgd"))  # two methods: the same code for all
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--interpret", "--layouts", "1",
                           "--repeats", "1", "--host-repeats", "1", "--only", only, "--out", str(out)],
                          capture_output=True, text=True, timeout=580, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_gpu.json").read_text())
    assert report["interpret"] and report["versions"]["device"].startswith("CPU")
    (layout,) = report["layouts"]
    assert layout["tensors"] == 1 and layout["copy_gbps"] > 0 and layout["targets"] == []
    rows = {r["primitive"]: r for r in layout["primitives"]}
    assert set(rows) == set(kernels.NAMES)  # every fused primitive
    assert all(r["ms"] > 0 and r["generic_ms"] > 0 and r["host_ms"] > 0 for r in rows.values())
    methods = {r["method"]: r for r in layout["methods"]}
    assert set(methods) == {"ef_sign", "global_qsgd"}
    assert all(r["ms"] > 0 and r["generic_ms"] > 0 and r["host_ms"] > 0 for r in methods.values())
    others = {r["name"]: r for r in layout["others"]}
    assert set(others) == {"DeepSpeed 1-bit, CuPy recipe", "PowerSGD hook, rank 1", "PowerSGD hook, rank 4"}
    assert all(r["ms"] is not None or r["skipped"] for r in others.values())
    # PowerSGD runs wherever torch.distributed has Gloo: measured (in its child process), not skipped.
    assert others["PowerSGD hook, rank 1"]["ms"] > 0 and others["PowerSGD hook, rank 4"]["ms"] > 0
    table = (out / "bench_gpu.md").read_text()
    assert "times mean nothing" in table and "| ef_sign |" in table and "| sign_pack |" in table


@pytest.mark.full
@pytest.mark.timeout(300)
def test_gpu_benchmark_tunes_the_launch_settings_under_the_interpreter(tmp_path):
    """bench_gpu.py --tune's harness (Triton's interpreter; its times mean nothing): each
    chosen family's candidates timed, outputs compared with the defaults' (the same here),
    the fastest written as JSON that the kernels accept (HVD_QUANT_GPU_LAUNCH), every
    timing in tune.json and tune.md."""
    import bench_gpu
    from triton_env import triton_env

    env = triton_env()
    if env is None:
        pytest.skip("Triton is not installed (scripts/bootstrap.sh --with-triton)")
    out, chosen = tmp_path / "gpu", tmp_path / "launch.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--interpret", "--tune", str(chosen),
                           "--only", "quantize_lanes,rebinarize", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    best = json.loads(chosen.read_text())
    assert set(best) == {"quantize_lanes", "rebinarize"}
    report = json.loads((out / "tune.json").read_text())
    for family, r in report["tune"].items():
        tried = [row["settings"] for row in r["rows"]]
        assert tried == bench_gpu.TUNE[family][1] and all(row["same"] and row["ms"] > 0 for row in r["rows"])
        assert best[family] in tried and r["best_ms"] == min(row["ms"] for row in r["rows"])
        assert r["default_ms"] is not None  # the defaults are among the candidates
    assert "| quantize_lanes | quantize_lanes |" in (out / "tune.md").read_text()
    check = subprocess.run([sys.executable, "-c", "import json, sys; from hvd_quant import kernels; "
                            "print(json.dumps(kernels.gpu_interpreted().set_launch(json.load(open(sys.argv[1])))))",
                            str(chosen)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout.splitlines()[-1])["rebinarize"] == best["rebinarize"]


def test_gpu_benchmark_reports_a_failed_powersgd_child(monkeypatch):
    """bench_gpu's PowerSGD child (a process of its own: its docstring says why) that
    exits non-zero, or measures nothing, gives every rank's row skipped with the reason;
    the benchmark goes on."""
    import bench_gpu
    import torch

    monkeypatch.setattr(sys, "executable", "false")  # a child that prints nothing and exits 1
    rows = bench_gpu.powersgd_in_child(torch.device("cpu"), [(4, 4)], 1)
    assert [r["name"] for r in rows] == ["PowerSGD hook, rank 1", "PowerSGD hook, rank 4"]
    assert all(r["ms"] is None and r["skipped"] == "child failed: exit status 1" for r in rows)
    monkeypatch.undo()
    # A device the child cannot use: it reports each rank skipped with torch's error, exit 0.
    rows = bench_gpu.powersgd_in_child(torch.device("meta"), [(4, 4)], 1)
    assert all(r["ms"] is None and r["skipped"] for r in rows), rows


def test_gpu_benchmark_judges_the_issues_targets():
    """bench_gpu.check_targets on made-up results: 60% of the copy bandwidth per hot
    primitive, the per-method milliseconds, 20x the host path, faster than the CuPy
    recipe and than PowerSGD's rank 4; a missing baseline is not judged; nothing is
    judged under the interpreter."""
    import bench_gpu

    prims = [{"primitive": name, "copy_share": 0.7} for name in bench_gpu.HOT]
    prims[0]["copy_share"] = 0.59
    result = {"primitives": prims,
              "methods": [{"method": "ef_sign", "ms": 1.5, "host_ms": 25.0},
                          {"method": "global_qsgd", "ms": 3.5, "host_ms": 100.0},
                          {"method": "onebit", "ms": 1.0, "host_ms": None}],
              "others": [{"name": "DeepSpeed 1-bit, CuPy recipe", "ms": 2.0},
                         {"name": "PowerSGD hook, rank 4", "ms": None, "skipped": "no NCCL"}]}
    got = {what: passed for what, _, passed in bench_gpu.check_targets(result, interpret=False)}
    assert got[f"{bench_gpu.HOT[0]} >= 60% of the copy bandwidth"] is False
    assert all(got[f"{name} >= 60% of the copy bandwidth"] for name in bench_gpu.HOT[1:])
    assert got["ef_sign <= 2 ms"] and got["global_qsgd <= 3 ms"] is False
    assert got["ef_sign >= 20x faster than the host path"] is False  # 25 / 1.5: 16.7x
    assert got["global_qsgd >= 20x faster than the host path"] is True
    assert got["onebit >= 20x faster than the host path"] is None  # not measured
    assert got["ef_sign faster than DeepSpeed's CuPy 1-bit recipe"] and \
        got["global_qsgd faster than DeepSpeed's CuPy 1-bit recipe"] is False
    assert got["ef_sign faster than PowerSGD's rank-4 compute"] is None  # the baseline did not run
    assert all(p is None for _, _, p in bench_gpu.check_targets(result, interpret=True))
    # Issue 56: a hashed primitive also passes within 1.5x of uniform alone (the draws by
    # themselves), whatever its share of the copy bandwidth.
    uniform = {"primitive": "uniform", "copy_share": 0.6, "ms": 0.2}
    hashed = [{"primitive": name, "copy_share": 0.05, "ms": ms}
              for name, ms in zip(bench_gpu.HASHED, (0.29, 0.31, 0.2, 0.5))]
    result["primitives"] = [uniform] + hashed
    got = {what.split(" ")[0]: (measured, passed) for what, measured, passed in
           bench_gpu.check_targets(result, interpret=False) if "uniform alone" in what}
    assert [got[name][1] for name in bench_gpu.HASHED] == [True, False, True, False]
    assert got[bench_gpu.HASHED[0]][0] == "5%, 1.45x uniform"


def test_keras_benchmark_speed_up_and_share_of_the_ideal(tmp_path):
    """bench_keras.py's bookkeeping on made-up raw results: the slowest rank per batch,
    the fp32 and floor times of the method's own rounds, ideal = floor + own wire time,
    % of ideal = (fp32 - t) / (fp32 - ideal), targets; table and plot written."""
    pytest.importorskip("matplotlib")
    import bench_keras

    def method(times, fp32, floor, sent):
        return {"times_s": times, "fp32_s": fp32, "floor_s": floor, "sent_bytes": sent, "kinds": []}
    # 1 Gbit/s: 12.5 MB is 100 ms on the wire.
    rank0 = {"ef_sign": method([0.30, 0.40, 0.35], [2.0, 2.2, 2.1], [0.2, 0.2, 0.2], 12.5e6),
             "fp16": method([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.2, 0.2, 0.2], 0.0)}
    rank1 = {"ef_sign": method([0.50, 0.30, 0.30], [2.0, 2.0, 2.0], [0.3, 0.1, 0.3], 12.5e6),
             "fp16": method([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.2, 0.2, 0.2], 0.0)}
    raw = {"config": {"ranks": 2, "hosts": 2, "rate_bps": 1e9, "batch": 4, "seq": 16, "chunk": 3, "repeats": 1,
                      "parameters": 1000, "fp32_sent_bytes": 4000.0, "new_kernel_signatures_while_timing": 0,
                      "threads": {"tf_intra_op": 1, "tf_inter_op": 1, "kernels": "1 thread"}},
           "per_rank": [rank0, rank1]}
    s = bench_keras.summarize(raw)
    ef = s["methods"]["ef_sign"]
    assert ef["median_s"] == pytest.approx(0.40)          # slowest ranks: 0.5, 0.4, 0.35
    assert ef["fp32_s"] == pytest.approx(2.1) and ef["floor_s"] == pytest.approx(0.3)
    assert ef["wire_s"] == pytest.approx(0.1) and ef["ideal_s"] == pytest.approx(0.4)
    assert ef["speedup"] == pytest.approx(2.1 / 0.4) and ef["pct_of_ideal"] == pytest.approx(100.0)
    assert ef["target"] == 3.5 and ef["meets_target"]
    assert s["methods"]["fp16"]["target"] is None and s["methods"]["fp16"]["meets_target"] is None
    assert bench_keras.target_of("tape:global_qsgd") == 2.0
    table = bench_keras.write_outputs(tmp_path, raw, ["bench_keras.py"])
    assert "| ef_sign | 400 | 2100 | 300 | 12.50 | 100 | 400 | 5.25x | 5.25x | 100% | 3.5x, 85%: met |" in table
    assert (tmp_path / "speedup.png").stat().st_size > 0 and (tmp_path / "results.json").exists()
    # Skipped (non-finite) timed steps did less work: flagged, and no target is met with them.
    rank1["ef_sign"]["skipped_steps"] = 3
    ef = bench_keras.summarize(raw)["methods"]["ef_sign"]
    assert ef["skipped_steps"] == 3 and not ef["meets_target"]
    table = bench_keras.write_outputs(tmp_path, raw, ["bench_keras.py"])
    assert "| ef_sign **3 timed step(s) skipped, not finite** | 400 |" in table and "**missed**" in table


@pytest.mark.multiprocess
@pytest.mark.timeout(560)
def test_gpu_training_job_on_the_cpu(tmp_path):
    """The GPU check's training job (``scripts/gpu_train_check.sh``, ``--cpu``: a tiny
    model on the CPU, the device optimizers' collectives staged through host buffers) runs
    end to end under ``horovodrun``: every compressor and 1-bit optimizer gives its CPU
    twin's bits on both ranks after every step and the ranks agree; every method and
    baseline is timed; the staged bytes are the collectives' payload; JSON and markdown
    are written. The model trains on stdlib text (vocabulary 512): after its 9 steps (6
    warm-up, 3 timed) every Adam-based method's held-out loss is below log(512), uniform
    guessing (the 1-bit optimizers, at 1e-5 and 1e-4, barely move in 9 steps: finite)."""
    import hvd_quant

    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HVD_QUANT_GPU_TRAIN_S="480")
    # --warmup 6 (the script's --cpu says 2): a few more steps, so that the loss has moved.
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train_check.sh"), str(out), "--cpu", "--",
                           "--warmup", "6"], capture_output=True, text=True, timeout=520, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_train.json").read_text())
    methods = hvd_quant.available() + ["onebit_adam", "zero_one_adam", "binsgdm"]
    assert sorted(result["bits"]) == sorted(methods)
    for name, bits in result["bits"].items():
        assert len(bits["steps"]) == 3, name
        for step in bits["steps"]:
            assert step["gpu_equals_cpu"] and step["max_ulps"] == 0, (name, step)
            assert step["ranks_agree"] is not False, (name, step)
        host = bits["host"]
        assert host["to_host"] + host["to_device"] == host["payload"] > 0, (name, host)
    # auto chose on a fixed slow link: the same compressed method on both devices.
    auto = result["bits"]["auto"]
    # (bucket names carry the owner's number: o0 the device optimizer, o1 its twin)
    assert list(auto["choices"].values()) == list(auto["twin_choices"].values()), auto
    assert auto["choices"] and auto["ranks_chose_alike"], auto
    assert "none" not in auto["choices"].values(), auto
    kinds = {name: [s["kind"] for s in bits["steps"]] for name, bits in result["bits"].items()}
    assert kinds["onebit_adam"] == ["init", "full", "onebit"]
    assert "local" in kinds["zero_one_adam"] or "onebit" in kinds["zero_one_adam"]
    assert sorted(result["timing"]) == sorted(["local", "ddp_fp32", "ddp_powersgd", "horovod_fp32"] + methods)
    data = result["config"]["data"]
    assert data["data"] == "stdlib" and data["vocab_size"] == 512 and data["corpus_digest"] and data["vocab_digest"]
    for name, row in result["timing"].items():
        assert len(row["step_s"]) == 3 and min(row["step_s"]) > 0, name
        if name in methods:
            assert row["sent_bytes"] > 0 and row["host"]["payload"] > 0, name
        loss = row["loss"]
        assert math.isfinite(loss["train_loss"]) and math.isfinite(loss["val_loss"]), (name, loss)
        if name not in ("onebit_adam", "zero_one_adam", "binsgdm"):
            assert loss["val_loss"] < math.log(512), (name, loss)
    report = (out / "gpu_train.md").read_text()
    assert all(f"| {m} |" in report for m in methods + ["ddp_powersgd", "horovod_fp32"])
    assert "1-bit methods faster than both" in report
    assert f"vocabulary {data['vocab_digest']}" in report
    assert "2 ranks:" in (out / "gpu_train.log").read_text()


def test_extrapolation_takes_the_shares_of_one_calibrated_rate():
    """``--shares-from RATE`` takes the shares of the link rate calibrated at that rate only
    (phase 2 of issue 42: at 1 Gbit/s 16 ranks on 2 cores could not fill the link, so its
    shares measure the CPUs); without it, the median over the calibrated rates; an unknown
    rate is an error that names the ones there are."""
    import costmodel_extrapolate as ex

    calibration = {"models": {
        "100mbit": {"efficiency": {"allreduce": 0.97, "allgather": 0.84, "alltoall": 0.57, "sendrecv": 0.79}},
        "1gbit": {"efficiency": {"allreduce": 0.51, "allgather": 0.80, "alltoall": 0.57, "sendrecv": 0.73}}}}
    one = ex.links(calibration, 25e-6, 1e-3, 20e9, 50e9, "100mbit")
    both = ex.links(calibration, 25e-6, 1e-3, 20e9, 50e9)
    for rate in ex.RATES:
        assert one[rate].efficiency == calibration["models"]["100mbit"]["efficiency"]
        assert both[rate].efficiency["allreduce"] == pytest.approx(0.74)
    with pytest.raises(SystemExit, match="100mbit, 1gbit"):
        ex.links(calibration, 25e-6, 1e-3, 20e9, 50e9, "10gbit")


PROBE_JOB = """
import json, sys
import horovod.torch as hvd
import scaling_probe as probe

hvd.init()
p = probe.parser()
chain = probe.chain(p.parse_args(["chain", "--kinds", "allreduce,allgather,alltoall,hop,two_phase",
                                  "--sizes", "4,4004", "--dtypes", "float32,float16", "--calls", "2",
                                  "--repeats", "2", "--waits", "spin,sleep", "--idle", "0.2"]))
digits = probe.digits(p.parse_args(["digits", "--configs", "none,ef_sign:seed=3,horovod_fp16",
                                    "--waits", "sleep", "--steps", "2", "--rounds", "2", "--hidden", "16"]))
if hvd.rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"chain": chain, "digits": digits}, f, allow_nan=True)
hvd.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_scaling_probe_chains_and_digits_steps_at_three_ranks(tmp_path):
    """``scaling_probe.py``'s two probes in one job at 3 ranks (an odd count: the two-phase
    allreduce pads its chunks): every kind of chain in float32 and float16 for both wait
    modes, each checked on its first call (ones in, the known sum out), timed with CPU
    time; the digits step through ``hq.DistributedOptimizer`` and Horovod's own fp16, with
    the collectives its waits saw (none for Horovod's own optimizer) and the bytes sent."""
    from horovod_launch import run_horovod

    script, out = tmp_path / "probe_job.py", tmp_path / "probe.json"
    script.write_text(PROBE_JOB)
    run_horovod(script, 3, [out], timeout=240, env={"PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)])})
    result = json.loads(out.read_text())
    chain = result["chain"]
    assert 0 <= chain.pop("idle")["cpu_s_per_s_mean_rank"] < 3
    kinds = ("allreduce", "allgather", "alltoall", "hop", "two_phase")
    expected = {f"{k}/{b}/{w}" + ("" if d == "float32" else f"/{d}")
                for k in kinds for b in (4, 4004) for w in ("spin", "sleep") for d in ("float32", "float16")}
    assert set(chain) == expected
    for key, row in chain.items():
        assert len(row["raw_slowest_s"]) == 4 and row["median_s"] > 0, key  # 2 repeats x 2 calls
        assert row["cpu_s_per_call_mean_rank"] > 0, key
    digits = result["digits"]
    assert set(digits) == {"none|sleep", "ef_sign:seed=3|sleep", "horovod_fp16|sleep"}
    for key, row in digits.items():
        assert len(row["step_s_rounds"]) == 2 and row["step_s_median"] > 0 and row["cpu_s_per_step_mean_rank"] > 0
    assert digits["none|sleep"]["collectives_per_step"] >= 1
    assert digits["ef_sign:seed=3|sleep"]["collectives_per_step"] >= 1
    assert digits["horovod_fp16|sleep"]["collectives_per_step"] == 0  # Horovod's optimizer: not our waits
    assert digits["ef_sign:seed=3|sleep"]["bytes_sent_total"] < digits["none|sleep"]["bytes_sent_total"]
