"""The model flags, written once for every command, and the int8 switch resolved once at the edge."""
from __future__ import annotations

import argparse

import pytest

from chatloom.model_args import INT8_ENV, add_model_args, int8_matmul
from chatloom.models.registry import DEFAULT_MODEL


@pytest.mark.parametrize("choice,env,expected", [(True, None, True), (False, "1", False), (None, "1", True),
                                                 (None, "yes", True), (None, "0", False), (None, None, None),
                                                 (None, "off", False)])
def test_int8_switch_is_the_flag_else_the_environment(monkeypatch, choice, env, expected):
    if env is None:
        monkeypatch.delenv(INT8_ENV, raising=False)
    else:
        monkeypatch.setenv(INT8_ENV, env)
    assert int8_matmul(choice) is expected


def test_models_do_not_read_the_environment(monkeypatch):
    import chatloom.models.packed_linear as packed_linear

    monkeypatch.setenv(INT8_ENV, "1")
    assert not hasattr(packed_linear, "int8_matmul_requested")
    assert "os.environ" not in open(packed_linear.__file__).read()


def test_flags_default_here_or_in_the_settings():
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args([])
    assert (args.model, args.dtype, args.int8_matmul) == (DEFAULT_MODEL, "fp32", None)
    p = argparse.ArgumentParser()
    add_model_args(p, from_settings=True)
    args = p.parse_args(["--int8-matmul"])
    assert (args.model, args.dtype, args.int8_matmul) == (None, None, True)
