"""The Tinker service's worker samples beside training (rollwise.service.worker): a tenant's asample completes
while another tenant's forward_backward is still running, and that forward_backward then completes as usual.

The API app and the worker run in this process (the API over HTTP through FastAPI's TestClient), so the test can
keep the forward_backward running: it holds the base model's lock, which every training forward over the base
takes. The single-threaded worker answered the sample only after the forward_backward."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from rollwise.serve.auth import ApiKeys
from rollwise.serve.front import Front
from rollwise.service.api import build_app
from rollwise.service.api_common import ApiSettings
from rollwise.service.base_models import BaseModels
from rollwise.service.sampler import Samplers
from rollwise.service.store import Store
from rollwise.service.worker import Worker
from rollwise.service.worker_ops import WorkerState

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BASE = "tiny:0"
KEY = "tml-" + "w" * 28


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data = tmp_path_factory.mktemp("tinker-threads")
    store = Store(f"sqlite:///{data / 'rows.db'}")
    bases = BaseModels(data, [BASE])
    base = bases.get(BASE)
    store.set_bases([(base.name, base.tokenizer_id, base.max_context_length)])
    worker = Worker(WorkerState(store=store, data_dir=data, bases=bases, samplers=Samplers(bases, max_num_seqs=4,
                                                                                           max_model_len=64)))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    app = build_app(store, Front(keys=ApiKeys([KEY], "test")), ApiSettings(long_poll_s=0.2))
    with TestClient(app, headers={"X-API-Key": KEY}) as client:
        yield client, store, base
    stop.set()
    thread.join(timeout=30)


def post(client: TestClient, path: str, **kw: object):
    r = client.post(f"/api/v1/{path}", **kw)
    assert r.status_code == 200, r.text
    return r.json()


def result(client: TestClient, request_id: str, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.headers["content-type"].startswith("application/x-protobuf") or r.json().get("type") != "try_again":
            return r
    raise AssertionError(f"request {request_id} did not finish in {deadline_s} s")


def fwdbwd_body(model_id: str, seq_id: int) -> bytes:
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8 + i]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8 + i, 9], "weights": [1.0, 1.0, 1.0, 1.0]})
            for i in range(3)]
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_a_sample_completes_while_another_tenants_forward_backward_runs(service):
    client, store, base = service
    session = post(client, "create_session", json={"tags": [], "user_metadata": None, "sdk_version": "test"})
    sid = session["session_id"]
    created = post(client, "create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE,
                                                 "lora_config": {"rank": 2}})
    model_id = created["model_id"]
    assert result(client, created["request_id"]).status_code == 200
    sampler = post(client, "create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                            "base_model": BASE})["sampling_session_id"]
    with base.lock:  # the forward_backward below runs, blocked inside its forward over the base
        fwd = post(client, "forward_backward", content=fwdbwd_body(model_id, 1),
                   headers={"Content-Type": "application/x-protobuf"})
        end = time.monotonic() + 60
        while store.request(fwd["request_id"]).status != "running":
            assert time.monotonic() < end, "the forward_backward never started running"
            time.sleep(0.01)
        sample = post(client, "asample", json={
            "sampling_session_id": sampler, "seq_id": 0, "num_samples": 2,
            "prompt": types.ModelInput.from_ints([5, 6, 7]).model_dump(mode="json"),
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1}})
        answer = result(client, sample["request_id"])
        # finished while the other tenant's forward_backward is still running
        assert store.request(fwd["request_id"]).status == "running"
    assert answer.status_code == 200
    sequences = pb.SampleResponse.FromString(answer.content).sequences
    assert len(sequences) == 2
    assert all(s.stop_reason == pb.STOP_REASON_LENGTH and len(s.tokens) == 3 * 4 for s in sequences)  # 3 int32s
    done = result(client, fwd["request_id"])
    assert done.status_code == 200
    out = pb.ForwardBackwardOutput.FromString(done.content)
    assert out.metrics["loss:sum"] > 0
