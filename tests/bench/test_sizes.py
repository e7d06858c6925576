"""`chatloom bench sizes` in its quick mode: chatloom measured as a server of its own, the peers that are
not on this machine skipped with a note, and the JSON's shape (the figures of a tiny model mean nothing)."""
from __future__ import annotations

import json

import pytest

from chatloom.bench import sizes
from chatloom.bench.checkpoints import SHAPES, make_checkpoint, shrink
from chatloom.cli import bench as bench_cli
from chatloom.cli.main import main

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(shrink(SHAPES["qwen2.5-1.5b"], **TINY), tmp_path_factory.mktemp("sizes"), seed=0)


def test_the_cli_names_the_same_servers():
    assert bench_cli.SIZES_SERVERS == sizes.SERVERS


def test_quick_run_measures_chatloom_and_notes_the_missing_peers(checkpoint, tmp_path, capsys):
    out = tmp_path / "sizes.json"
    assert main(["bench", "sizes", "--model", str(checkpoint.gguf_file), "--quick", "--llama-server",
                 str(tmp_path / "no-such-binary"), "--out", str(out), "--log-dir", str(tmp_path / "logs"),
                 "--table"]) == 0
    printed, table = capsys.readouterr()
    result = json.loads(printed)
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "sizes" and result["plan"]["max_tokens"] == sizes.QUICK.max_tokens
    assert result["read_bandwidth_gbps"] > 0
    (model,) = result["models"]
    assert model["weight_bytes_per_step"] > 0 and model["roofline_tpot_ms"] > 0
    servers = model["servers"]
    assert list(servers) == list(sizes.SERVERS)
    assert "no-such-binary" in servers["llama-server"]["skipped"]
    assert "skipped" in servers["vllm"]  # not importable here, or no Hugging Face folder given
    ours = servers["chatloom"]
    assert "error" not in ours, ours
    assert ours["failed_requests"] == 0 and ours["output_tokens_as_asked"]
    assert ours["context_window"] == 8192  # the shape's 32,768 positions, capped by default
    assert ours["load_to_ready_s"] > 0 and 0 < ours["rss_after_load_mib"] <= ours["rss_peak_mib"]
    one = ours["one_in_flight"]
    for key in ("tpot_p50_ms", "short_prompt_ttft_p50_ms", "long_prompt_ttft_ms", "long_prompt_prefill_tok_s",
                "tpot_at_long_context_ms"):
        assert one[key] > 0, key
    assert one["long_prompt_tokens"] >= sizes.QUICK.long_prompt > one["short_prompt_tokens"] - 40
    many = ours["in_flight"]
    assert many["completed"] == sizes.QUICK.chat_requests and many["in_flight"] == 8
    assert many["output_tok_s"] > 0 and 0 < many["ttft_p50_ms"] <= many["ttft_p90_ms"]
    assert ours["busy"]["tpot_p50_ms"] > 0 and ours["busy"]["over_quiet"] > 0
    assert ours["roofline_share"] > 0
    assert "| 1 in flight: TPOT p50, ms |" in table and "llama-server: no llama-server binary" in table
    assert (tmp_path / "logs" / f"{checkpoint.gguf_file.stem}-chatloom.log").is_file()


def test_load_rounds_start_each_server_in_turn_and_report_medians(checkpoint, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["bench", "sizes", "--model", str(checkpoint.gguf_file), "--quick",
                 "--servers", "chatloom,llama-server,vllm", "--llama-server", str(tmp_path / "no-such-binary"),
                 "--vllm-python", str(tmp_path / "no-such-python"), "--hf-folder", str(tmp_path),
                 "--load-rounds", "2", "--out", str(out), "--table"]) == 0
    printed, table = capsys.readouterr()
    result = json.loads(printed)
    assert json.loads(out.read_text()) == result and result["benchmark"] == "sizes-load"
    assert "no-such-binary" in result["skipped"]["llama-server"]
    assert "no-such-python" in result["skipped"]["vllm"]  # the Python given, not this one
    runs = result["starts"]["chatloom"]
    assert len(runs) == 2 and all("error" not in r for r in runs), runs
    for r in runs:
        assert r["load_to_ready_s"] > 0 and r["cpu_s"] > 0 and r["rss_after_load_mib"] > 0
    med = result["medians"]["chatloom"]
    assert min(r["load_to_ready_s"] for r in runs) <= med["load_to_ready_s"] <= max(r["load_to_ready_s"] for r in runs)
    assert "| median |" in table


def test_a_run_of_some_phases_sends_only_their_requests(checkpoint, tmp_path, capsys):
    """`--phases short,busy` (a TPOT A/B on a quiet machine) runs no long prompt and no in-flight chats:
    their figures are null and the server saw only the warm-up, short and busy requests."""
    assert main(["bench", "sizes", "--model", str(checkpoint.gguf_file), "--quick", "--servers", "chatloom",
                 "--phases", "short,busy", "--tpot-requests", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["phases"] == ["short", "busy"] and result["plan"]["tpot_requests"] == 3
    ours = result["models"][0]["servers"]["chatloom"]
    assert ours["failed_requests"] == 0 and ours["one_in_flight"]["tpot_p50_ms"] > 0
    assert ours["busy"]["tpot_p50_ms"] > 0
    assert ours["one_in_flight"]["long_prompt_ttft_ms"] is None
    assert ours["in_flight"]["completed"] == 0 and ours["in_flight"]["output_tok_s"] is None


def test_an_unknown_phase_is_one_clear_line(checkpoint, capsys):
    assert main(["bench", "sizes", "--model", str(checkpoint.gguf_file), "--quick", "--phases", "short,warp"]) != 0
    err = capsys.readouterr().err
    assert "unknown phase 'warp'" in err and "Traceback" not in err


def test_a_missing_model_file_is_one_clear_line(tmp_path, capsys):
    assert main(["bench", "sizes", "--model", str(tmp_path / "nope.gguf"), "--quick"]) != 0
    err = capsys.readouterr().err
    assert "no GGUF file at" in err and "Traceback" not in err


def test_prompts_have_the_length_asked_and_no_shared_prefix():
    from chatloom.models.loader import load_tokenizer

    texts = sizes.Texts(load_tokenizer("smollm2-135m-instruct"), seed=0)
    a, b = texts.text(100), texts.text(100)
    assert a.split()[:2] != b.split()[:2]
    assert 90 <= len(texts.tokenizer.encode(a)) <= 110
    chat = texts.conversation(1000)
    assert chat[-1]["role"] == "user" and {m["role"] for m in chat} == {"user", "assistant"}
    assert 900 <= sum(len(texts.tokenizer.encode(m["content"])) for m in chat) <= 1200


def test_vllm_runs_from_the_python_it_is_given(tmp_path):
    target = sizes.Target(tmp_path / "m.gguf", hf_folder=tmp_path / "hf")
    python = tmp_path / "bin-python"
    assert "no Python at" in sizes._argv("vllm", target, sizes.QUICK, 8000, None, None, python)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    argv = sizes._argv("vllm", target, sizes.QUICK, 8000, None, None, python)
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(tmp_path / "hf")
    # Per sequence (the longest conversation or the long prompt, with the answer), not the whole cache:
    # a model's own window (8,192 for the 1.7B shape) refuses the cache-sized 26,624.
    plan = sizes.SizesPlan()
    full = sizes._argv("vllm", target, plan, 8000, None, None, python)
    assert int(full[full.index("--max-model-len") + 1]) == plan.sequence_tokens() == 4352 < plan.context_tokens()


def _result(model: str, chatloom_tpot: float) -> dict:
    server = {"rss_after_load_mib": 1300.0, "busy": {"over_quiet": 1.8},
              "one_in_flight": {"tpot_p50_ms": chatloom_tpot, "long_prompt_ttft_ms": 35000.0},
              "in_flight": {"output_tok_s": 4.3, "ttft_p90_ms": 90000.0}}
    return {"benchmark": "sizes", "models": [{"model": model, "servers": {
        "chatloom": server, "llama-server": {**server, "busy": {"over_quiet": 68.0}},
        "vllm": {"skipped": "not installed"}}}]}


def test_sizes_plot_draws_the_models_of_several_runs(tmp_path, capsys):
    from chatloom.bench.sizes_plot import figure_value, models_of

    files = []
    for name, tpot in (("/m/a-1.7b.gguf", 22.7), ("/m/b-3b.gguf", 41.0)):
        files.append(tmp_path / f"{tpot}.json")
        files[-1].write_text(json.dumps(_result(name, tpot)))
    png = tmp_path / "sizes.png"
    assert main(["bench", "sizes-plot", *map(str, files), "--out", str(png)]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == ["a-1.7b", "b-3b"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    models = models_of([_result("/m/a.gguf", 22.7)])
    assert [(label, sorted(s)) for label, s in models] == [("a", ["chatloom", "llama-server"])]  # skipped left out
    # Runs of one model merge: a server measured in a run of its own joins the others.
    vllm = {"benchmark": "sizes", "models": [{"model": "/m/a.gguf", "servers": {"vllm": {"busy": {"over_quiet": 1}}}}]}
    assert [sorted(s) for _, s in models_of([_result("/m/a.gguf", 22.7), vllm])] == [["chatloom", "llama-server", "vllm"]]
    assert figure_value(models[0][1]["chatloom"], ("in_flight", "ttft_p90_ms")) == 90.0  # shown in seconds
    assert figure_value(models[0][1]["chatloom"], ("one_in_flight", "missing")) is None


def test_sizes_plot_refuses_a_file_that_is_not_a_sizes_result(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "router"}))
    assert main(["bench", "sizes-plot", str(other), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "not a `chatloom bench sizes` result" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "sizes-plot", str(tmp_path / "absent.json"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a readable JSON file" in capsys.readouterr().err
