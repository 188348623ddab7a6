"""Fast smoke runs of the benchmark commands on the tiny model: they run and report sane JSON."""

import json

import pytest

from pagedserve.bench import forward, kv, prefix, scheduler_overhead, throughput


def last_json(capsys):
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    return [json.loads(ln) for ln in lines]


def test_scheduler_overhead_smoke():
    r = scheduler_overhead.measure(32, 5)
    assert r["running_requests"] == 32 and r["total_us_per_step"] > 0


def test_throughput_with_hf_baseline_and_plot(checkpoint, tmp_path, capsys):
    out = tmp_path / "t.json"
    png = tmp_path / "t.png"
    throughput.main(
        [
            "--model",
            checkpoint("llama"),
            "--dtype",
            "float32",
            "--num-requests",
            "6",
            "--input-len",
            "4",
            "20",
            "--output-len",
            "2",
            "8",
            "--baseline",
            "hf-static",
            "--hf-batch-sizes",
            "1",
            "4",
            "--output-json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    (r,) = last_json(capsys)
    assert r["pagedserve"]["requests"] == 6 and r["ratio_vs_best_baseline"] > 0
    assert [b["batch_size"] for b in r["baseline"]] == [1, 4]
    assert json.loads(out.read_text())["num_requests"] == 6 and png.stat().st_size > 1000


def test_kv_sweep_smoke(checkpoint, tmp_path, capsys):
    kv.main(
        [
            "--model",
            checkpoint("llama"),
            "--dtype",
            "float32",
            "--num-requests",
            "8",
            "--input-len",
            "4",
            "40",
            "--output-len",
            "2",
            "12",
            "--block-sizes",
            "8",
            "16",
            "--kv-tokens",
            "512",
            "--max-model-len",
            "256",
            "--plot",
            str(tmp_path / "kv.png"),
        ]
    )
    (r,) = last_json(capsys)
    for row in r["results"]:
        assert 0 < row["paged_util_min"] <= row["paged_util_mean"] <= 1
        assert row["contiguous_util_mean"] < row["paged_util_mean"]
        assert row["max_concurrent_paged"] > row["max_concurrent_contiguous"]


def test_prefix_bench_smoke(checkpoint, capsys):
    prefix.main(
        [
            "--model",
            checkpoint("llama"),
            "--dtype",
            "float32",
            "--requests",
            "4",
            "--system-len",
            "64",
            "--question-len",
            "8",
            "--output-len",
            "3",
            "--n",
            "3",
            "--n-prompts",
            "2",
            "--n-prompt-len",
            "40",
        ]
    )
    a, b = last_json(capsys)
    assert a["with_caching"]["prompt_tokens_computed"] < a["without_caching"]["prompt_tokens_computed"]
    assert a["with_caching"]["prefix_cache_hit_tokens"] == 3 * 64
    assert b["with_caching"]["prefix_cache_hit_tokens"] > 0


def test_forward_smoke(checkpoint, capsys):
    forward.main(
        [
            "--model",
            checkpoint("llama"),
            "--dtypes",
            "float32",
            "--batches",
            "2",
            "--context",
            "16",
            "--prefill-len",
            "32",
            "--steps",
            "2",
        ]
    )
    rows = last_json(capsys)
    assert {r["what"] for r in rows} == {"prefill", "decode_b2"} and all(r["ratio"] > 0 for r in rows)


def test_forward_profile_smoke(checkpoint, capsys):
    """--profile times the runner's parts in the dtype asked (it had fallen behind a rename)."""
    forward.main(["--model", checkpoint("llama"), "--profile", "--dtypes", "bfloat16", "--batches", "2", "--steps", "2"])
    (row,) = last_json(capsys)
    assert row["dtype"] == "bfloat16" and row["batch"] == 2
    assert {"prepare", "forward", "logits", "sample", "step"} <= set(row["fused_ms"]) and row["fused_ms"]["step"] > 0


def test_serve_bench_compares_static(checkpoint, tmp_path, capsys):
    """Against the static scheduler and LLM.generate, on a directory without weights: both the
    server and the offline run must take --load-format=dummy (gpu_check.sh serves an 8B shape so)."""
    import shutil

    from pagedserve.bench import serve

    weightless = tmp_path / "weightless"
    shutil.copytree(checkpoint("llama"), weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    serve.main(
        [
            "--launch",
            str(weightless),
            "--dtype",
            "float32",
            "--compare-static",
            "--compare-offline",
            "--server-arg=--num-kv-blocks=256",  # not the 2 GiB default, committed at start
            "--server-arg=--load-format=dummy",
            "--max-concurrency",
            "6",
            "--max-num-seqs",
            "4",
            "--num-requests",
            "8",
            "--request-rate",
            "50",
            "--input-len",
            "4",
            "30",
            "--output-len",
            "2",
            "10",
            "--plot",
            str(tmp_path / "lat.png"),
        ]
    )
    (r,) = last_json(capsys)
    for mode in ("continuous", "static"):
        run = r["runs"][mode]
        assert run["completed"] == 8 and run["failed"] == 0 and run["ttft_s"]["p50"] > 0
    assert r["ttft_p50_static_over_continuous"] > 0
    assert r["offline"]["output_tok_s"] > 0 and r["continuous_over_offline"] > 0


def test_gpu_bench_script_smoke(tmp_path):
    """benchmarks/gpu_bench.py (run for real by benchmarks/gpu_check.sh on a GPU) at tiny shapes."""
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_bench.py",
            "--smoke",
            "--ctx",
            "32",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    r = json.loads(out.read_text())
    assert {row["what"] for row in r["runs"]} == {"decode", "prefill"} and r["params"] > 0


def test_spec_bench_smoke(checkpoint, capsys):
    from pagedserve.bench import spec

    spec.main(["--model", checkpoint("llama"), "--dtype", "float32", "--k", "2", "--max-tokens", "8", "--batch-load", "3"])
    (r,) = last_json(capsys)
    assert r["batch1"]["identical_outputs"] is True and r["batch1"]["plain_tok_s"] > 0
    assert r["load"]["ratio"] > 0


def test_spec_bench_draft_model_smoke(checkpoint, capsys):
    """--draft-layers 1: the target's first layer as its draft (a checkpoint of its own)."""
    from pagedserve.bench import spec

    spec.main(["--model", checkpoint("llama"), "--dtype", "float32", "--k", "2", "--max-tokens", "8",
               "--method", "draft_model", "--draft-layers", "1", "--draft-quantization", "int8"])
    (r,) = last_json(capsys)
    assert r["method"] == "draft_model" and r["draft"]["quantization"] == "int8"
    assert r["batch1"]["identical_outputs"] is True and r["batch1"]["drafts"] > 0


def test_truncated_draft_of_a_gguf_holds_its_first_layers(checkpoint, tmp_path, monkeypatch):
    """A GGUF's conversion holds no weights: the draft's come from the file itself."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q

    from pagedserve.bench.spec import truncated_draft
    from pagedserve.executor.loader import iterate_weights
    from tests.executor.test_gguf import write_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(checkpoint("llama"), str(tmp_path / "m.gguf"), Q.Q8_0)
    names = {n for n, _ in iterate_weights(truncated_draft(path, 1))}
    assert "model.embed_tokens.weight" in names and any(n.startswith("model.layers.0.") for n in names)
    assert not any(n.startswith("model.layers.1.") for n in names)


def test_quant_kernels_bench_smoke(capsys):
    from pagedserve.bench import quant

    quant.main(["kernels", "--shapes", "96x64", "--rows", "1,4", "--rounds", "1"])
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "quant_kernels" and [r["M"] for r in out["rows"]] == [1, 4]
    assert all(us > 0 for r in out["rows"] for us in r["us"].values())


def test_dashboard_overhead_bench_smoke(capsys):
    from pagedserve.bench import dashboard_overhead

    dashboard_overhead.main(["--blocks", "300", "--model", "", "--rounds", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "dashboard_snapshot" and out["num_blocks"] == 300 and out["build_snapshot_ms"] > 0


def test_structured_bench_smoke(checkpoint, capsys):
    from pagedserve.bench import structured

    structured.main(["--model", checkpoint("llama"), "--parts", "compile,validity", "--samples", "2", "--output-len", "8"])
    parts = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [p["part"] for p in parts][:1] == ["compile"]
    assert any(p["part"] == "validity" for p in parts)


def test_workload_is_seeded_and_within_its_ranges():
    import argparse

    from pagedserve.bench.workload import add_workload_args, make_workload

    ap = argparse.ArgumentParser()
    add_workload_args(ap, num_requests=20)
    a = ap.parse_args(["--seed", "3"])
    w1, w2 = make_workload(a, vocab=500), make_workload(a, vocab=500)
    assert w1 == w2 and len(w1) == 20
    assert all(all(0 <= t < 500 for t in p) and n >= 1 for p, n in w1)


def test_mixed_workload_and_summary(tmp_path):
    from pagedserve.bench.mixed import make_mixed_workload, plot, summarize_mixed

    work = make_mixed_workload(200, seed=3)
    assert work == make_mixed_workload(200, seed=3)
    longs = [w for w in work if w["cls"] == "long"]
    assert 25 <= len(longs) <= 55  # ~20%
    assert all(1500 <= len(w["prompt"]) <= 3000 and 300 <= w["out"] <= 800 for w in longs)
    assert all(32 <= len(w["prompt"]) <= 256 and 8 <= w["out"] <= 64 for w in work if w["cls"] == "short")
    results = [
        {"ok": True, "cls": w["cls"], "ttft": 0.1 if w["cls"] == "short" else 2.0, "tpot": 0.05, "e2e": 1.0, "tokens": w["out"]}
        for w in work
    ]
    s = summarize_mixed({"results": results, "duration": 100.0}, slo_ttft_ms=500)
    assert s["short"]["n"] + s["long"]["n"] == 200 and s["short"]["ttft_s"]["p99"] == 0.1
    assert s["short_ttft_slo"] == {"target_ms": 500, "attained": s["short"]["n"], "of": s["short"]["n"]}
    png = tmp_path / "m.png"
    plot({"x": {"results": results}}, str(png))
    assert png.stat().st_size > 1000
    from pagedserve.bench.mixed import main

    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"summary": s, "results": results}))
    both = tmp_path / "ab.png"
    main(["--compare", f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}", "--plot", str(both)])
    assert both.stat().st_size > png.stat().st_size // 2


def test_embed_bench_offline_smoke(checkpoint, capsys):
    from pagedserve.bench import embed

    embed.main(["--offline", "--model", checkpoint("llama"), "--num", "12", "--len", "4", "40", "--batch", "4", "--vocab", "1000"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pagedserve_inputs_per_s"] > 0 and out["min_cosine_vs_baseline"] > 0.9999


def test_prefix_restart_bench_smoke(checkpoint, capsys, tmp_path):
    prefix.main(
        ["--restart", "--model", checkpoint("llama"), "--dtype", "float32", "--docs", "4", "--asks", "2",
         "--doc-min", "40", "--doc-max", "64", "--pool-docs", "1.5", "--kv-offload-dir", str(tmp_path),
         "--decode-check", "--decode-requests", "2", "--decode-lens", "24", "4"]
    )
    r, d = last_json(capsys)
    assert d["output_tok_s_on"] > 0 and d["output_tok_s_off"] > 0
    assert r["with_tier"]["prompt_tokens_computed"] < r["lru_only"]["prompt_tokens_computed"]
    assert r["with_tier"]["tier_hit_blocks"] > 0
    assert r["after_restart"]["hit_blocks"] == (64 + 16 - 1) // 16 and r["restart_indexed_blocks"] > 0


def test_server_flags_take_values_and_bare_switches():
    """--server-arg values for LocalServer: "name=value" pairs and bare switches (True, or
    False as --no-X)."""
    from pagedserve.bench.serve import server_flags

    assert server_flags(["--no-kv-cache-prefault", "--enforce-eager", "--max-num-seqs=64", "--x=a=b"]) == {
        "kv_cache_prefault": False,
        "enforce_eager": True,
        "max_num_seqs": "64",
        "x": "a=b",
    }


@pytest.mark.parametrize("name", ["gpu_check.sh", "gpu_serve_profile.sh"])
def test_gpu_scripts_name_files_and_modules_that_exist(name):
    """The GPU scripts run only on a lent GPU, so nothing else notices when a file or module
    they name moves (gpu_check.sh's test paths went stale once): every tests/ and benchmarks/
    path they name exists, and every `python -m` module is importable."""
    import importlib.util
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (root / "benchmarks" / name).read_text()
    paths = set(re.findall(r"\b((?:tests|benchmarks)/[\w/.-]+\.(?:py|sh))", script))
    modules = set(re.findall(r"-m (pagedserve[\w.]*)", script))
    assert "pagedserve.bench.serve" in modules  # both serve the model over HTTP
    assert [p for p in sorted(paths) if not (root / p).is_file()] == []
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []


def test_pyspy_summary_counts_inclusive_and_self_samples():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "pyspy_summary.py"
    spec = importlib.util.spec_from_file_location("pyspy_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = ["main (a/x.py:1);step (b/y.py:2);sample (b/y.py:9) 3\n", "main (a/x.py:1);idle (a/x.py:5) 1\n", "\n"]
    total, inclusive, own = mod.summarize(lines)
    assert total == 4 and inclusive["main x.py:1"] == 4 and inclusive["step y.py:2"] == 3
    assert own == {"sample y.py:9": 3, "idle x.py:5": 1}
