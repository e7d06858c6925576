"""The `chatloom` command: subprocess runs for the end-to-end behaviour, in-process
runs (same `main`) for the long list of bad inputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatloom.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, input: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "chatloom.cli", *args], input=input, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def call(capsys, *argv: str) -> tuple[int, str, str]:
    """main() in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse exits for usage errors and --help
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("chatloom: error:"), err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])


# -- end to end, in a subprocess ---------------------------------------------------------

def test_help_lists_the_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for command in ("generate", "chat", "models", "capacity", "bench"):
        assert command in r.stdout


def test_models_json():
    r = run_cli("models", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["id"]: row for row in json.loads(r.stdout)}
    smol = rows["smollm2-135m-instruct"]
    assert smol["layers"] == 30 and smol["kv_heads"] == 3 and smol["head_dim"] == 64
    assert smol["context_length"] == 8192
    assert smol["kv_bytes_per_token"] == {"fp32": 46080, "bf16": 23040}
    assert 130e6 < smol["parameters"] < 140e6
    assert rows["tiny-random"]["test_only"]


def test_capacity_of_the_70b_example():
    r = run_cli("capacity", "--model", "chatloom/examples/llama-70b.json", "--memory-gb", "80")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "327,680 bytes (320 KiB)" in out
    assert "2,621,440,000 bytes (2.62 GB, 2.44 GiB)" in out
    assert "tokens that fit: 244,140" in out
    assert "concurrent 8,000-token conversations: 30" in out
    r = run_cli("capacity", "--model", "llama-70b", "--memory-gib", "80", "--json")
    data = json.loads(r.stdout)
    assert data["kv_bytes_per_token"] == 327_680
    assert data["bytes_per_conversation"] == 2_621_440_000
    assert data["tokens"] == 80 * 2**30 // 327_680 == 262_144
    assert data["conversations"] == 32


def test_capacity_prints_weight_memory(capsys):
    rc, out, err = call(capsys, "capacity", "--model", "mistral-7b", "--memory-gib", "1", "--weights", "all")
    assert rc == 0, err
    assert "weights as loaded (Q4_K_M file, fp32 model):" in out and "(6.07 GiB)" in out  # the embedding in Q6_K
    assert "weights as loaded (any file, every weight in bfloat16):" in out
    rc, out, _ = call(capsys, "capacity", "--model", "mixtral-8x7b", "--memory-gib", "1", "--weights", "Q8_0", "--json")
    assert list(json.loads(out)["weight_bytes"]) == ["Q8_0"]


def test_capacity_without_a_budget_shows_the_engines_default_pool(capsys, monkeypatch):
    from chatloom.engine import config as engine_config

    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 64 * 2**30)
    rc, out, err = call(capsys, "capacity", "--model", "smollm2-135m-instruct")
    assert rc == 0, err
    assert "KV cache per token (fp32): 46,080 bytes" in out  # the exact mode keeps float32
    assert "wanted: 4 sequences x 8,192 tokens x 46,080 bytes" in out
    assert "pool: 2,048 blocks x 16 tokens = 32,768 tokens" in out and "context window: 8,192 tokens" in out
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 2**30)
    rc, out, _ = call(capsys, "capacity", "--model", "smollm2-135m-instruct", "--dtype", "bf16", "--json")
    r = json.loads(out)
    assert r["dtype"] == "bf16" and r["pool"]["how"] == "auto"
    assert r["pool"]["bytes"] <= r["pool"]["cap_bytes"] == (2**30 - r["weight_bytes_estimate"]) // 2


def test_capacity_counts_a_window_on_every_layer(capsys):
    rc, out, err = call(capsys, "capacity", "--model", "phi-3-mini-4k", "--memory-gib", "4", "--json")
    assert rc == 0, err
    r = json.loads(out)
    # Phi-3-mini's 2,047-token window: 128 blocks of 16 inside it, the one being filled, one more.
    assert r["sliding_window"] == 2047 and r["tokens_held_per_conversation"] == 130 * 16
    assert r["bytes_per_conversation"] == r["kv_bytes_per_token"] * 2080
    assert r["conversations"] == 4 * 2**30 // (r["kv_bytes_per_token"] * 2080)


def test_generate_with_the_tiny_model():
    r = run_cli("generate", "hello there", "--model", "tiny-random", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and len(r.stdout) > 1
    assert r.stderr == ""


def test_chat_through_a_pipe():
    r = run_cli("chat", "--model", "tiny-random", "--max-tokens", "4", "--temperature", "0",
                input="first message\n\nsecond message\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    answers = [a for a in r.stdout.split("\n\n") if a.strip()]
    assert len(answers) == 2  # two turns answered, the line after /exit ignored


def test_generate_paris_with_the_bundled_model():
    r = run_cli("generate", "--chat", "What is the capital of France?", "--temperature", "0", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_inputs_in_a_subprocess(tmp_path):
    r = run_cli("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert_one_line_error(r.returncode, r.stderr, "not found", "missing.gguf")
    r = run_cli("generate", "hi", "--max-tokens", "-1")
    assert_one_line_error(r.returncode, r.stderr, "--max-tokens")
    assert r.returncode == 2


# -- in process ---------------------------------------------------------------------------

def test_generate_is_reproducible_with_a_seed(capsys):
    args = ("generate", "once upon", "--model", "tiny-random", "--max-tokens", "12", "--seed", "7",
            "--temperature", "1.0")
    rc1, out1, _ = call(capsys, *args)
    rc2, out2, _ = call(capsys, *args)
    assert rc1 == rc2 == 0 and out1 == out2
    rc3, out3, _ = call(capsys, *args[:-4], "--seed", "8", "--temperature", "1.0")
    assert rc3 == 0 and out3 != out1


def test_generate_chat_with_system_prompt(capsys):
    rc, out, err = call(capsys, "generate", "hi", "--chat", "--system", "Be brief.", "--model", "tiny-random",
                        "--max-tokens", "3", "-v")
    assert rc == 0
    assert "prompt" in err and "output tokens" in err


def test_models_table(capsys):
    rc, out, _ = call(capsys, "models")
    assert rc == 0
    assert "smollm2-135m-instruct" in out and "tiny-random" in out
    assert "46,080 B (45 KiB)" in out


def test_models_describes_given_paths(capsys):
    rc, out, _ = call(capsys, "models", "chatloom/examples/llama-70b.json", "--json")
    assert rc == 0
    (row,) = json.loads(out)
    assert row["layers"] == 80 and row["kv_bytes_per_token"]["bf16"] == 327_680
    assert 70e9 < row["parameters"] < 71e9


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "corrupt.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    (root / "text.gguf").write_text("this is not a model\n")
    gpt2 = root / "gpt2-folder"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    broken = root / "broken-config"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    return root


BAD_INPUTS = {
    "missing file": (["generate", "hi", "--model", "{root}/nope.gguf"], ["not found"]),
    "corrupt gguf": (["generate", "hi", "--model", "{root}/corrupt.gguf"], ["cannot read GGUF file"]),
    "not a gguf": (["generate", "hi", "--model", "{root}/text.gguf"], ["cannot read GGUF file"]),
    "unsupported architecture": (["generate", "hi", "--model", "{root}/gpt2-folder"], ["unsupported architecture 'gpt2'"]),
    "broken config.json": (["generate", "hi", "--model", "{root}/broken-config"], ["config"]),
    "unknown model id": (["generate", "hi", "--model", "gpt-17"], ["unknown model 'gpt-17'"]),
    "prompt longer than the context": (["generate", "x" * 2100, "--model", "tiny-random"], ["context window"]),
    "negative max tokens": (["generate", "hi", "--max-tokens", "-5"], ["--max-tokens"]),
    "zero max tokens": (["generate", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    "max tokens not a number": (["generate", "hi", "--max-tokens", "lots"], ["--max-tokens"]),
    "negative temperature": (["generate", "hi", "--temperature", "-0.5"], ["--temperature"]),
    "nan temperature": (["generate", "hi", "--temperature", "nan"], ["--temperature"]),
    "top-p above 1": (["generate", "hi", "--top-p", "1.5"], ["--top-p"]),
    "top-p zero": (["generate", "hi", "--top-p", "0"], ["--top-p"]),
    "negative top-k": (["generate", "hi", "--top-k", "-3"], ["--top-k"]),
    "unknown dtype": (["generate", "hi", "--dtype", "int3"], ["--dtype"]),
    "system without chat": (["generate", "hi", "--system", "x", "--model", "tiny-random"], ["--system"]),
    "no prompt": (["generate"], ["prompt"]),
    "unknown command": (["frobnicate"], ["frobnicate"]),
    "no command": ([], ["command"]),
    "unknown option": (["models", "--colour"], ["--colour"]),
    "capacity of an fp8 engine pool": (["capacity", "--model", "llama-70b", "--dtype", "fp8"], ["fp8"]),
    "capacity negative memory": (["capacity", "--model", "llama-70b", "--memory-gb", "-1"], ["--memory-gb"]),
    "capacity unknown model": (["capacity", "--model", "nope", "--memory-gb", "1"], ["unknown model"]),
    "capacity unsupported config": (["capacity", "--model", "{root}/gpt2-folder/config.json", "--memory-gb", "1"],
                                    ["unsupported architecture"]),
    "chat with a missing model": (["chat", "--model", "{root}/nope.gguf"], ["not found"]),
    "models with an unknown id": (["models", "nope"], ["unknown model"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_line(capsys, bad_files, case):
    argv, needles = BAD_INPUTS[case]
    argv = [a.replace("{root}", str(bad_files)) for a in argv]
    rc, out, err = call(capsys, *argv)
    assert_one_line_error(rc, err, *needles)
    assert rc == 2


def test_chat_reports_an_overlong_message_and_goes_on(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("y" * 2100 + "\nshort\n"))
    # Greedy: sampled, the random-weight model sometimes ended the answer at once (empty in a CI run).
    rc, out, err = call(capsys, "chat", "--model", "tiny-random", "--max-tokens", "2", "--temperature", "0")
    assert rc == 0
    assert err.count("chatloom: error:") == 1 and "context window" in err
    assert out.strip()  # the second message was answered


def test_keyboard_interrupt_exits_130_quietly(capsys, monkeypatch):
    import chatloom.cli.main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_models", interrupted)
    rc, out, err = call(capsys, "models")
    assert rc == 130 and err == ""


def test_other_modules_can_register_commands(capsys, monkeypatch):
    import chatloom.cli.bench as bench_cli

    def register(subparsers):
        p = subparsers.add_parser("hello-test")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)

    monkeypatch.setattr(bench_cli, "register", register)
    rc, out, _ = call(capsys, "hello-test", "--name", "loom")
    assert rc == 0 and out == "hello loom\n"


def test_serve_int8_flag_reaches_the_settings(tmp_path, monkeypatch):
    """`serve --int8-matmul` and the TOML key set the backend's matmul; absent, the env decides."""
    import argparse

    from chatloom.cli.serve import _settings, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    monkeypatch.delenv("CHATLOOM_MODEL__INT8_MATMUL", raising=False)
    assert _settings(parser.parse_args(["serve", "--int8-matmul"])).model.int8_matmul is True
    assert _settings(parser.parse_args(["serve"])).model.int8_matmul is None  # the loader decides by the file
    monkeypatch.setenv("CHATLOOM_MODEL__INT8_MATMUL", "1")
    assert _settings(parser.parse_args(["serve"])).model.int8_matmul is True
    monkeypatch.delenv("CHATLOOM_MODEL__INT8_MATMUL")
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nint8_matmul = true\n")
    assert _settings(parser.parse_args(["serve", "--config", str(toml)])).model.int8_matmul is True
