"""A gateway over local replicas admits as many generations at once as its replicas run together, and its
autoscaler acts on them even when [[fleet.models]] serves other models beside them."""
from __future__ import annotations

from chatloom.app.main import create_app
from chatloom.serving.local_fleet import LocalReplicas
from chatloom.serving.multi_model import MultiModelBackend
from chatloom.serving.router import Router

from app_testing import make_settings
from traffic_testing import ScriptedBackend


def _app(tmp_path, **overrides):
    local = LocalReplicas("tiny-random", 2)  # never started: the wiring needs only their URLs
    router = Router("tiny-random", local.urls)
    backend = MultiModelBackend({"tiny-random": router, "small": ScriptedBackend()})
    settings = make_settings(tmp_path, engine={"max_num_seqs": 3}, degrade={"small_model": "small"},
                             autoscale={"enabled": True, "capacity_rps": 1.0, "max_replicas": 3}, **overrides)
    return create_app(settings, backend, local_replicas=local), router, local


def test_the_autoscaler_acts_on_the_local_replicas_beside_another_model(tmp_path):
    app, router, local = _app(tmp_path)
    ctx = app.state.ctx
    assert ctx.scaler.router is router and ctx.scaler.local is local
    assert ctx.traffic.admission.max_running == 6  # two replicas of three sequences each
    ctx.scaler.on_resize(3)  # a third replica joined
    assert ctx.traffic.admission.max_running == 9 and ctx.traffic.admission.reasoning_slots() == 4
    ctx.scaler.on_resize(1)
    assert ctx.traffic.admission.max_running == 3


def test_an_admission_limit_set_by_the_operator_stays(tmp_path):
    app, _, _ = _app(tmp_path, traffic={"admission_max_running": 5})
    ctx = app.state.ctx
    assert ctx.traffic.admission.max_running == 5
    ctx.scaler.on_resize(3)
    assert ctx.traffic.admission.max_running == 5
