"""`chatloom bench perplexity` (the shipped public-domain text, per mode), `bench kquant-matmul` and
`bench attention`."""
from __future__ import annotations

import json
import math

from chatloom.bench.perplexity import TEXT, negative_log_likelihood, run_perplexity, windows
from chatloom.cli.main import main


def test_the_text_ships_and_is_a_few_kilobytes():
    assert 2000 < len(TEXT.read_bytes()) < 10000


def test_windows_cover_every_token_once():
    ids = list(range(23))
    ws = windows(ids, 5)
    assert [t for w in ws for t in w] == ids  # 23 = 4 windows of 5 and one of 3
    assert all(len(w) > 1 for w in ws)


def test_perfect_prediction_has_perplexity_one():
    import torch

    class Oracle:  # puts all its mass on the next token of the window
        def dense_logits(self, seqs):
            (s,) = seqs
            out = torch.full((len(s), 50), -1e9)
            for i in range(len(s) - 1):
                out[i, s[i + 1]] = 0.0
            return [out]

    nll, n = negative_log_likelihood(Oracle(), windows(list(range(40)), 7))
    assert n == 40 - 6 and abs(nll) < 1e-6


def test_tiny_model_modes(capsys):
    result = run_perplexity("tiny-random", ["exact", "int8", "bf16"], window=64, max_tokens=200)
    assert result["tokens"] == 200
    exact = result["modes"]["exact"]["perplexity"]
    assert math.isfinite(exact) and exact > 1
    assert "skipped" in result["modes"]["int8"]  # no quantized layers in the random model
    assert abs(result["perplexity_ratio"]["bf16/exact"] - 1) < 0.05
    assert main(["bench", "perplexity", "--model", "tiny-random", "--modes", "exact", "--max-tokens", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"]["exact"]["tokens_scored"] == 49


def test_kquant_matmul_bench(capsys):
    assert main(["bench", "kquant-matmul", "--kinds", "Q4_K", "Q6_K", "--k", "256", "--n", "32",
                 "--rows", "1", "3", "--seconds", "0.01", "--layers", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["kinds"]) == {"Q4_K", "Q6_K"}
    assert out["kinds"]["Q4_K"]["bytes_per_weight"] == 0.75
    assert out["kinds"]["Q6_K"]["bytes_per_weight"] == 1.5
    assert out["kinds"]["Q6_K"]["by_rows"]["3"]["float32_ms"] > 0
    if "superblock_bytes_per_weight" in out["kinds"]["Q4_K"]:  # the super-block kernel (AVX-512)
        # 4.625 and 6.5625 bits, and the panels' offsets and kinds (26 bytes for these 8,192 weights)
        assert out["kinds"]["Q4_K"]["superblock_bytes_per_weight"] == round((4.625 / 8 * 8192 + 26) / 8192, 4)
        assert out["kinds"]["Q6_K"]["superblock_bytes_per_weight"] == round((6.5625 / 8 * 8192 + 26) / 8192, 4)
        assert out["kinds"]["Q6_K"]["by_rows"]["1"]["superblock_gb_per_s"] > 0
    if "superblock_int8_ms" in out["kinds"]["Q4_K"]["by_rows"]["1"]:  # int8 on the super-blocks (VNNI)
        assert out["kinds"]["Q4_K"]["by_rows"]["3"]["superblock_int8_gb_per_s"] > 0


def test_kv_cache_modes_run_through_a_pool_of_their_dtype():
    from chatloom.cli import bench as bench_cli
    from chatloom.bench.perplexity import MODES, parse_mode

    assert bench_cli.PERPLEXITY_MODES == MODES
    assert parse_mode("int8+bf16kv") == ("int8", "bf16") and parse_mode("exact") == ("exact", "auto")
    result = run_perplexity("tiny-random", ["exact", "exact+fp16kv", "exact+bf16kv"], window=64, max_tokens=200)
    modes = result["modes"]
    assert [modes[m]["kv_cache_dtype"] for m in ("exact", "exact+fp16kv", "exact+bf16kv")] == [
        "float32", "float16", "bfloat16"]
    # Rounding K/V changes the scores a little, never a lot; bf16 (8 bits of mantissa) more than fp16 (11).
    fp16, bf16 = (abs(modes[m]["perplexity"] - modes["exact"]["perplexity"]) for m in ("exact+fp16kv", "exact+bf16kv"))
    assert 0 < fp16 < bf16 < 0.01 * modes["exact"]["perplexity"]


def test_the_cached_path_with_a_float32_pool_matches_the_dense_logits():
    import torch

    from chatloom.bench.perplexity import cached_logits
    from chatloom.models import load_model

    model = load_model("tiny-random").model
    chunk = list(range(3, 60))
    torch.testing.assert_close(cached_logits(model, chunk, torch.float32), model.dense_logits([chunk])[0],
                               rtol=1e-5, atol=1e-5)


def test_attention_bench_reports_both_layouts_against_a_plain_read(capsys):
    assert main(["bench", "attention", "--sequences", "3", "--positions", "40", "--layers", "2",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seconds", "0.01"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= out["kv_lens"][0] <= out["kv_lens"][1] <= 40
    # The scattered pools hold every layer's blocks; the cached ones one layer's, reused by all.
    assert out["layouts"]["scattered"]["pool_blocks"] == 2 * out["layouts"]["cached"]["pool_blocks"] > 0
    for layout in out["layouts"].values():
        assert "avx2" in layout["by_path"]
        assert all(p["ms_per_step"] > 0 and p["gb_per_s"] > 0 for p in layout["by_path"].values())
    assert out["plain_read"]["gb_per_s"] > 0 and out["fraction_of_plain_read"] > 0


def test_attention_bench_refuses_heads_that_do_not_share_kv_heads_evenly(capsys):
    assert main(["bench", "attention", "--heads", "9", "--kv-heads", "2", "--seconds", "0.01"]) != 0
    err = capsys.readouterr().err
    assert "--heads (9) must be a multiple of --kv-heads (2)" in err
    assert "Traceback" not in err


def test_kquant_matmul_bench_on_thread_cpu_time(capsys):
    import torch

    args = ["bench", "kquant-matmul", "--kinds", "Q4_K", "--k", "256", "--n", "32", "--rows", "1",
            "--seconds", "0.01", "--cpu-time"]
    threads = torch.get_num_threads()
    try:
        assert main(args + ["--threads", "1"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["clock"] == "thread CPU time" and out["kinds"]["Q4_K"]["by_rows"]["1"]["exact_ms"] > 0
        # Two threads: the calling thread's CPU time would miss the other's work.
        assert main(args + ["--threads", "2"]) != 0
        assert "--threads 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
