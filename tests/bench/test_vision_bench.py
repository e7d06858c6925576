"""`chatloom bench vision` on the tiny random Idefics3: the JSON it prints (the figures themselves need a
real checkpoint and a quiet machine)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chatloom.bench.vision import run_vision
from chatloom.cli.main import main
from chatloom.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import tiny_vision as tv  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tv.write_idefics3_folder(tmp_path_factory.mktemp("vision") / "tiny-vlm")


def test_the_vision_bench_measures_both_questions_and_the_text_streams(folder):
    result = run_vision(load_model(str(folder)), rounds=1, streams=2, max_tokens=4, image_every=2)
    assert result["ttft"]["first_question_s"] > 0 and result["ttft"]["second_question_s"] > 0
    assert result["text_streams"]["itl_p90_quiet_s"] > 0 and result["text_streams"]["itl_p90_with_images_s"] > 0
    assert result["image_tokens"] == (4 * 4 + 1) * 4
    # The round's questions encode one image (the second question reuses it); the image requests still
    # waiting for their encoder when the streams end are aborted.
    streams = result["text_streams"]
    assert streams["image_requests"] == 2 and result["encoder_pieces"] == 17 + streams["encoder_pieces"]
    assert 0 <= streams["encoder_share"] < 1 and streams["itl_mean_with_images_s"] > 0
    # Finished pieces took at least a slice each; the work is counted in whole pieces.
    assert streams["encoder_slices"] >= streams["encoder_pieces"]
    assert streams["encoder_piece_equivalents"] >= streams["encoder_pieces"]


def test_rounds_run_in_pairs_that_take_turns_going_first(folder):
    result = run_vision(load_model(str(folder)), rounds=2, streams=2, max_tokens=2, image_every=2)
    # A load that rises through the run weighs on quiet and busy rounds alike.
    assert result["text_streams"]["round_order"] == ["quiet", "busy", "busy", "quiet"]
    assert len(result["text_streams"]["itl_p90_quiet_rounds_s"]) == 2


def test_without_pacing_the_streams_wait_for_every_piece(folder):
    from chatloom.engine import EngineConfig

    result = run_vision(load_model(str(folder)), rounds=1, streams=2, max_tokens=4, image_every=1,
                        config=EngineConfig(encoder_max_slowdown=float("inf")))
    # Nothing holds the encoder back but the step's budget: each image's 17 tiles in the 4 steps.
    assert result["encoder_max_slowdown"] == float("inf")
    assert result["text_streams"]["encoder_pieces"] >= 17


def test_the_cli_prints_json_and_refuses_a_text_model(folder, capsys):
    assert main(["bench", "vision", "--model", str(folder), "--rounds", "1", "--max-tokens", "2",
                 "--streams", "1", "--encoder-max-slowdown", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "vision" and out["encoder_max_slowdown"] == 0.5
    assert main(["bench", "vision", "--model", "tiny-random"]) == 2
    assert "does not take images" in capsys.readouterr().err
