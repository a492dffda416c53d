"""`rollwise serve tinker` end to end: the unmodified `tinker` SDK (0.38) against a live server on loopback
(the real CLI, its worker and its API child process), on a tiny random model.

One server for the module. Raw HTTP (with the SDK's own request types and protobuf) only where the SDK cannot
send the request under test (malformed bodies, reused seq ids, another key's ids)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from rollwise.service.store import Store
from tests.tinker_server import TinkerServer, tinker_server

BASE = "tiny:0"
KEY_A = "tml-" + "a" * 28
KEY_B = "tml-" + "b" * 28
KEY_C = "tml-" + "c" * 28
KEY_PLAIN = "p" * 32  # no `tml-`: the SDK sends it only through TINKER_CREDENTIAL_CMD
MAX_BYTES = 1_000_000
MAX_QUEUED = 12
ADAM = types.AdamParams(learning_rate=1e-2)


class Server(TinkerServer):
    def result(self, request_id: str, key: str = KEY_A) -> httpx.Response:
        while True:
            r = self.post("retrieve_future", key, json={"request_id": request_id})
            if r.status_code != 200 or r.headers["content-type"].startswith("application/x-protobuf"):
                return r
            if r.json().get("type") != "try_again":
                return r

    def api_pid(self) -> int:
        return int(self.get("healthz").json()["pid"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with tinker_server(tmp_path_factory.mktemp("tinker"), [KEY_A, KEY_B, KEY_C, KEY_PLAIN], BASE, "--threads", "1",
                       "--log-level", "warning", "--max-request-bytes", str(MAX_BYTES),
                       "--max-queued-per-key", str(MAX_QUEUED), "--long-poll", "5", timeout_s=90,
                       server_cls=Server) as srv:
        yield srv


def sft_data(n: int = 3) -> list[types.Datum]:
    data = []
    for i in range(n):
        toks = [(7 * i + 3 * t) % 50 + 5 for t in range(12)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)}))
    return data


def logprobs_of(out: types.ForwardBackwardOutput) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def assert_close(a: list[list[float]], b: list[list[float]], atol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) <= atol, (x, y)


def test_sft_lowers_loss_and_sampler_serves_the_trained_weights(server: Server) -> None:
    tc = server.client().create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    assert tc.get_info().model_data.tokenizer_id  # a local directory the SDK's tokenizer loads offline
    assert tc.get_tokenizer().encode("hi")
    data = sft_data()
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.9, losses

    sampler = tc.save_weights_and_get_sampling_client().result()  # ephemeral: a push to the engine, no disk write
    prompt = [5, 9, 13, 17]
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=2)).result()
    assert len(res.sequences) == 3
    assert len({s.sequence_id for s in res.sequences}) == 3
    datums = []
    for seq in res.sequences:
        assert seq.tokens and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        full = prompt + seq.tokens
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                  loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)}))
    # the engine's sampled logprobs are the trained model's: the trainer's forward scores them the same
    trained = logprobs_of(tc.forward(datums, "cross_entropy").result())
    assert_close([s.logprobs for s in res.sequences], [t[len(prompt) - 1:] for t in trained], atol=1e-3)
    assert not list((server.data_dir).glob("*/sampler_weights/*"))


def test_save_state_load_state_resume_bit_exact(server: Server) -> None:
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    data = sft_data(2)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    path = tc.save_state("ck1").result().path
    assert path.endswith("/weights/ck1") and path.startswith(f"tinker://{tc.model_id}/")
    before = logprobs_of(tc.forward(data, "cross_entropy").result())
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert logprobs_of(tc.forward(data, "cross_entropy").result()) != before
    tc.load_state_with_optimizer(path).result()
    assert logprobs_of(tc.forward(data, "cross_entropy").result()) == before
    tc2 = sc.create_training_client_from_state_with_optimizer(path).result()
    assert logprobs_of(tc2.forward(data, "cross_entropy").result()) == before
    run = sc.create_rest_client().get_training_run(tc.model_id).result()
    assert run.is_lora and run.lora_rank == 4 and run.last_checkpoint.tinker_path == path


def model_rows(server: Server, model_id: str) -> list[tuple[int, str]]:
    store = Store(f"sqlite:///{server.data_dir / 'requests.sqlite'}")
    with store.engine.connect() as c:
        return [(int(r[0]), str(r[1])) for r in c.exec_driver_sql(
            "SELECT seq_id, status FROM requests WHERE model_id = ?", (model_id,)).all()]


def test_killed_api_process_restarts_and_every_accepted_future_completes_once(server: Server) -> None:
    data = sft_data(8)

    def submit(tc: tinker.TrainingClient) -> list:
        return [f for _ in range(6) for f in (tc.forward_backward(data, "cross_entropy"), tc.optim_step(ADAM))]

    reference = [f.result() for f in submit(server.client().create_lora_training_client(
        base_model=BASE, rank=4, seed=11).result())]
    tc = server.client().create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    pid = server.api_pid()
    futures = submit(tc)
    deadline = time.monotonic() + 60
    while not [seq for seq, status in model_rows(server, tc.model_id) if status != "done"]:
        assert time.monotonic() < deadline, "no request of the model was seen accepted and unfinished"
    os.kill(pid, signal.SIGKILL)  # mid-run: requests accepted and not finished, others not sent yet
    results = [f.result(timeout=120) for f in futures]
    losses = [r.metrics["loss:sum"] for r in results[::2]]
    assert losses == [r.metrics["loss:sum"] for r in reference[::2]]  # each step ran once, in order
    rows = model_rows(server, tc.model_id)
    assert sorted(seq for seq, _ in rows) == list(range(13))  # create + 12 operations, one row each
    assert {status for _, status in rows} == {"done"}
    deadline = time.monotonic() + 60
    while True:  # the supervisor started another API process
        try:
            assert server.api_pid() != pid
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def two_steps(tc: tinker.TrainingClient) -> list[float]:
    futures = [(tc.forward_backward(sft_data(2), "cross_entropy"), tc.optim_step(ADAM)) for _ in range(2)]
    return [fb.result().metrics["loss:sum"] for fb, op in futures if op.result() is not None]


def test_tenants_training_concurrently_get_what_each_gets_alone(server: Server) -> None:
    alone = two_steps(server.client(KEY_A).create_lora_training_client(base_model=BASE, rank=4, seed=7).result())
    a = server.client(KEY_A).create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    b = server.client(KEY_B).create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    futures = {name: [(tc.forward_backward(sft_data(2), "cross_entropy"), tc.optim_step(ADAM)) for _ in range(2)]
               for name, tc in (("a", a), ("b", b))}  # both queued at once: the worker batches them
    for pairs in futures.values():
        together = [fb.result().metrics["loss:sum"] for fb, op in pairs if op.result() is not None]
        assert together == pytest.approx(alone, rel=1e-5)


def test_two_keys_are_isolated(server: Server) -> None:
    tc = server.client(KEY_A).create_lora_training_client(base_model=BASE, rank=4).result()
    path = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    for route, body in (("get_info", {"model_id": tc.model_id}),
                        ("load_weights", {"model_id": tc.model_id, "seq_id": 9, "path": path, "optimizer": False}),
                        ("save_weights", {"model_id": tc.model_id, "seq_id": 9, "path": "x"})):
        r = server.post(route, KEY_B, json=body)
        assert r.status_code == 404, (route, r.text)
        assert r.json()["error"]["param"] in ("model_id", "path")  # as for an id that does not exist
    assert server.get(f"training_runs/{tc.model_id}", KEY_B).status_code == 404
    other = server.client(KEY_B)
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=sampler_path).result()
    mine = server.client(KEY_A).create_sampling_client(model_path=sampler_path).result()
    sample = server.post("asample", KEY_B, json={"sampling_session_id": mine._sampling_session_id, "num_samples": 1,
                                                 "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
                                                 "sampling_params": {"max_tokens": 2}})
    assert sample.status_code == 404


# ---------------------------------------------------------------- refusals (raw HTTP with the SDK's own types)


def raw_model(server: Server, key: str = KEY_A) -> str:
    session = server.post("create_session", key, json={"tags": [], "user_metadata": None, "sdk_version": "test"})
    sid = session.json()["session_id"]
    r = server.post("create_model", key, json={"session_id": sid, "model_seq_id": 0, "base_model": BASE,
                                                "lora_config": {"rank": 4}})
    assert server.result(r.json()["request_id"], key).status_code == 200
    return r.json()["model_id"]


def fwdbwd_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy", forward_only: bool = False) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=sft_data(2), loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    msg = forward_backward_request_to_proto(req)
    msg.loss_fn, msg.forward_only = loss_fn, forward_only
    return msg.SerializeToString()


def submit_fwdbwd(server: Server, body: bytes, key: str = KEY_A) -> httpx.Response:
    return server.post("forward_backward", key, content=body, headers={"Content-Type": "application/x-protobuf"})


def forward_logprobs(server: Server, model_id: str, seq_id: int) -> list[bytes]:
    r = submit_fwdbwd(server, fwdbwd_body(model_id, seq_id, forward_only=True))
    out = server.result(r.json()["request_id"])
    msg = pb.ForwardBackwardOutput.FromString(out.content)
    return [bytes(msg.loss_fn_outputs[0].fields["logprobs"].data)]


def failed(server: Server, response: httpx.Response) -> dict[str, str]:
    assert response.status_code == 200, response.text
    return server.result(response.json()["request_id"]).json()


def test_refusals_get_the_sdk_error_category_and_leave_the_model_untouched(server: Server) -> None:
    model = raw_model(server)
    before = forward_logprobs(server, model, 1)

    err = failed(server, submit_fwdbwd(server, fwdbwd_body(model, 2, loss_fn="no_such_loss")))
    assert err["category"] == "user" and "loss_fn" in err["error"]
    err = failed(server, submit_fwdbwd(server, b"\xff\xff\xff garbage"))
    assert err["category"] == "user" and "protobuf" in err["error"]
    err = failed(server, submit_fwdbwd(server, fwdbwd_body(model, 1)))  # seq_id 1 was used: not run again
    assert err["category"] == "user" and "seq_id" in err["error"]
    big = submit_fwdbwd(server, b"\0" * (MAX_BYTES + 1))
    assert big.status_code == 413 and big.json()["error"]["param"] == "data"
    bad_key = server.post("create_session", "tml-" + "z" * 28, json={"tags": [], "user_metadata": None,
                                                                     "sdk_version": "test"})
    assert bad_key.status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        server.client("tml-" + "z" * 28).create_lora_training_client(base_model=BASE, rank=4).result()

    # a loss the SDK sends but this server does not implement: a user error through the SDK itself
    tc = server.client().create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError) as refused:
        tc.forward_backward(sft_data(1), "stable_reinforce").result()
    assert refused.value.category == types.RequestErrorCategory.User

    assert forward_logprobs(server, model, 3) == before  # seq 2 (refused) took its turn, changed nothing


def test_queue_quota_answers_429(server: Server) -> None:
    model = raw_model(server, KEY_C)
    # seq ids after a gap wait for the missing ones: they stay queued and count against the key's quota
    codes = [submit_fwdbwd(server, fwdbwd_body(model, 100 + i), KEY_C).status_code for i in range(MAX_QUEUED)]
    assert set(codes) == {200}
    over = submit_fwdbwd(server, fwdbwd_body(model, 999), KEY_C)
    assert over.status_code == 429 and over.headers["Retry-After"]
    assert submit_fwdbwd(server, fwdbwd_body(raw_model(server, KEY_B), 1), KEY_B).status_code == 200  # others not


def test_session_and_capability_routes(server: Server) -> None:
    assert server.post("client/config", json={"sdk_version": "0.38.0"}).json()["pjwt_auth_enabled"] is False
    caps = server.client().get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    sid = server.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    sid = sid["session_id"]
    assert server.post("session_heartbeat", json={"session_id": sid}).status_code == 200
    assert server.post("session_heartbeat", KEY_B, json={"session_id": sid}).status_code == 404
    created = server.post("create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE,
                                                "lora_config": {"rank": 2}})
    model = created.json()["model_id"]
    assert server.result(created.json()["request_id"]).status_code == 200
    assert server.post(f"sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert server.post("session_heartbeat", json={"session_id": sid}).status_code == 410
    time.sleep(1.2)  # the worker unloads the models of finished sessions (its memory follows the live sessions)
    err = failed(server, submit_fwdbwd(server, fwdbwd_body(model, 1, forward_only=True)))
    assert err["category"] == "user" and "not loaded" in err["error"]
    assert server.post("telemetry", json={"events": []}).json() == {"status": "accepted"}


def test_full_parameter_model_trains_and_samples(server: Server) -> None:
    """The SDK only creates LoRA clients; a full-parameter model (no lora_config) over the same wire."""
    sid = server.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    sid = sid["session_id"]
    created = server.post("create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": BASE})
    model = created.json()["model_id"]
    assert server.result(created.json()["request_id"]).status_code == 200
    assert server.post("get_info", json={"model_id": model}).json()["is_lora"] is False
    losses = []
    for step in range(2):
        fb = submit_fwdbwd(server, fwdbwd_body(model, 2 * step + 1))
        opt = server.post("optim_step", json={"model_id": model, "seq_id": 2 * step + 2,
                                              "adam_params": {"learning_rate": 1e-3}})
        out = pb.ForwardBackwardOutput.FromString(server.result(fb.json()["request_id"]).content)
        losses.append(out.metrics["loss:sum"])
        assert "metrics" in server.result(opt.json()["request_id"]).json()
    assert losses[1] < losses[0]
    saved = server.post("save_weights_for_sampler", json={"model_id": model, "seq_id": 5,
                                                          "sampling_session_seq_id": 0})
    sampler = server.result(saved.json()["request_id"]).json()["sampling_session_id"]
    sample = server.post("asample", json={"sampling_session_id": sampler, "num_samples": 2, "seq_id": 0,
                                          "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                                          "sampling_params": {"max_tokens": 3, "temperature": 1.0}})
    assert len(sample.json()["sample_sequence_ids"]) == 2
    msg = pb.SampleResponse.FromString(server.result(sample.json()["request_id"]).content)
    assert len(msg.sequences) == 2  # int32 tokens and float32 logprobs: one of each per sampled token
    assert all(len(s.tokens) == len(s.logprobs) > 0 for s in msg.sequences)


def test_sample_importance_sampling_step_sample_shows_the_new_policy(server: Server) -> None:
    tc = server.client().create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    prompt = [11, 12, 13]
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
    rewarded = res.sequences[0]  # advantage +1 for the first sample, 0 for the others
    data = []
    for i, seq in enumerate(res.sequences):
        full = prompt + seq.tokens
        n = len(full) - 1
        mask = [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)
        old = [0.0] * (len(prompt) - 1) + list(seq.logprobs or [])
        adv = 1.0 if i == 0 else 0.0
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:], "logprobs": old, "advantages": [a * adv for a in mask][:n]}))
    before = sum(sampler.compute_logprobs(types.ModelInput.from_ints(prompt + rewarded.tokens)).result()[len(prompt):])
    for _ in range(2):
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    new_sampler = tc.save_weights_and_get_sampling_client().result()
    after = sum(new_sampler.compute_logprobs(types.ModelInput.from_ints(prompt + rewarded.tokens)).result()[
        len(prompt):])
    assert after > before + 0.1, (before, after)  # the rewarded sample is likelier under the new policy
    # the old sampler still serves the old weights (a snapshot, not the live model)
    again = sum(sampler.compute_logprobs(types.ModelInput.from_ints(prompt + rewarded.tokens)).result()[len(prompt):])
    assert again == pytest.approx(before, abs=1e-5)


def test_forward_backward_custom_equals_the_same_loss_computed_locally(server: Server) -> None:
    """The SDK's forward_backward_custom: a forward, the loss and its gradient on the client, then cross_entropy with
    weights = -dC/dlogp (negative here: this loss pushes the targets' probabilities down). A second model with the
    same seed trained on those weights computed here must end with the same weights (its logprobs equal)."""
    data = sft_data(2)

    def loss_of(logprobs: list) -> object:  # C = sum(logp + 0.05 logp^2): dC/dlogp = 1 + 0.1 logp > 0 here
        return sum((lp + 0.05 * lp * lp).sum() for lp in logprobs)

    def custom(batch: list[types.Datum], logprobs: list) -> tuple[object, dict[str, float]]:
        loss = loss_of(logprobs)
        return loss, {"custom:sum": float(loss)}

    custom_tc = server.client().create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    local_tc = server.client().create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    before = logprobs_of(local_tc.forward(data, "cross_entropy").result())
    out = custom_tc.forward_backward_custom(data, custom).result()
    custom_tc.optim_step(ADAM).result()

    import torch  # (the SDK's custom path needs torch too)

    expected = float(loss_of([torch.tensor(lp) for lp in before]))
    assert abs(out.metrics["custom:sum"] - expected) < 1e-3 * abs(expected)
    weighted = [types.Datum(model_input=d.model_input,
                            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                            "weights": [-(1.0 + 0.1 * v) for v in lp]})
                for d, lp in zip(data, before, strict=True)]
    assert all(w < 0 for d in weighted for w in d.loss_fn_inputs["weights"].tolist())
    local_tc.forward_backward(weighted, "cross_entropy").result()
    local_tc.optim_step(ADAM).result()
    after_custom = logprobs_of(custom_tc.forward(data, "cross_entropy").result())
    after_local = logprobs_of(local_tc.forward(data, "cross_entropy").result())
    assert_close(after_custom, after_local, atol=1e-4)
    assert max(abs(a - b) for x, y in zip(after_custom, before) for a, b in zip(x, y)) > 1e-3  # it did train


def test_a_key_the_sdk_refuses_as_api_key_is_named_at_start_up_and_still_served(server: Server) -> None:
    """The SDK refuses a key without `tml-` client-side as api_key / TINKER_API_KEY, but sends one printed by
    TINKER_CREDENTIAL_CMD unchecked: so the server keeps it, and its start-up names the key file's line."""
    log = (server.data_dir.parent / "server.log").read_text()
    assert "keys.txt, line 4: this key does not start with 'tml-'" in log
    assert "line 1: this key" not in log and "line 3: this key" not in log
    with pytest.raises(tinker.TinkerError, match="tml-"):
        tinker.ServiceClient(base_url=server.url, api_key=KEY_PLAIN).get_server_capabilities()
    assert server.get("get_server_capabilities", KEY_PLAIN).status_code == 200
