"""`chatloom batch run`: a Batch API input file run offline, output and error files beside each other."""
from __future__ import annotations

import json

from chatloom.cli.main import main


def request(custom_id: str, url: str = "/v1/chat/completions", **body) -> str:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
            "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_batch_run_writes_output_and_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CHATLOOM_RUNTIME__KERNELS", "0")
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([request("a"), "[1, 2", request("b"), request("a")]) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["batch", "run", str(source), "-o", str(out), "--model", "tiny-random", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "2 of 4 requests answered, 2 failed" in err
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["a", "b"]
    assert all(a["response"]["status_code"] == 200 and a["response"]["body"]["usage"]["completion_tokens"] == 3
               for a in answers)
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(2, "invalid_json_line"),
                                                                         (4, "duplicate_custom_id")]


def test_batch_run_bad_input_is_one_line(tmp_path, capsys):
    rc = main(["batch", "run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no such file" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc = main(["batch", "run", str(empty), "-o", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "url" in err
    assert not (tmp_path / "o.jsonl").exists()
