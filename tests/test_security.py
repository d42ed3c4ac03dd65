"""Issue #9: let no one in. A stranger on the network, built from the .proto files alone and
without the cluster's secret, replays the attacks of the report against a cluster in token and
in mtls mode; forged KV and KV from a prefill worker the router did not choose never land."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pdcommon.client import make_request
from pdcommon.convert import params_to_proto
from pdcommon.v1 import worker_pb2 as wpb
from pdcommon.v1 import worker_pb2_grpc as wrpc
from pdserve.certs import make_certs
from tests.cluster_utils import InProcessCluster, make_config, send_once
from transfer import TransferState, build_header

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time there was a little girl"


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> Path:
    """The stranger's folder: code generated from proto/ by protoc, and its script. Nothing else."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("stranger")
    # Its own copy of the .proto files, under a package name of its own: what it imports cannot be
    # pdserve's generated code. The wire names (package pdserve.v1) are the .proto files' own.
    src = out / "src" / "stranger_api" / "v1"
    src.mkdir(parents=True)
    for proto in (ROOT / "proto" / "pdcommon" / "v1").glob("*.proto"):
        (src / proto.name).write_text(proto.read_text().replace('import "pdcommon/v1/', 'import "stranger_api/v1/'))
    inc = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{out / 'src'}", f"-I{inc}", f"--python_out={out}", f"--grpc_python_out={out}",
                      *(f"stranger_api/v1/{p.name}" for p in src.glob("*.proto"))])
    assert rc == 0
    shutil.copy(ROOT / "tests" / "stranger.py", out / "stranger.py")
    return out


def run_stranger(folder: Path, cl: InProcessCluster, certs: Path | None = None) -> dict:
    members = cl.core.members.workers
    prefill = next(w.address for w in members.values() if w.role == "prefill")
    decode = next(w.address for w in members.values() if w.role == "decode")
    args = [cl.router.control_address, prefill, decode, *([str(certs)] if certs else [])]
    # -E -s: no PYTHONPATH, no user site; its own folder comes first on sys.path.
    r = subprocess.run([sys.executable, "-E", "-s", str(folder / "stranger.py"), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _unchanged(cl: InProcessCluster, before: dict) -> None:
    members = cl.core.members.workers
    assert {w: r.address for w, r in members.items()} == before, "a stranger changed the cluster's membership"
    assert cl.core.targets == {"prefill": 1, "decode": 1}
    assert not any(r.inflight for r in members.values())


@pytest.mark.parametrize("mode", ["token", "mtls"])
def test_a_stranger_is_refused_everywhere(stories_path, stranger, tmp_path, mode):
    sec = {"security.mode": mode}
    if mode == "mtls":
        sec["security.certs_dir"] = str(make_certs(tmp_path / "cluster-certs"))
    cfg = make_config(stories_path, **sec)
    with InProcessCluster(cfg) as cl, cl.client() as c:
        before = {w: r.address for w, r in cl.core.members.workers.items()}
        out = run_stranger(stranger, cl)
        calls = ("register", "heartbeat", "scale", "prefill", "decode")
        # token: refused by the check; mtls: the TLS handshake itself fails (no client certificate).
        want = "UNAUTHENTICATED" if mode == "token" else "UNAVAILABLE"
        assert {k: out[k] for k in calls} == {k: want for k in calls}
        if mode == "mtls":  # a certificate of another CA is refused just the same, and so is none at all
            out = run_stranger(stranger, cl, make_certs(tmp_path / "stranger-certs"))
            assert {k: out[k] for k in calls} == {k: "UNAVAILABLE" for k in calls}
            ca_only = tmp_path / "ca-only"
            ca_only.mkdir()
            shutil.copy(Path(cfg.security.certs_dir) / "ca.pem", ca_only / "ca.pem")
            out = run_stranger(stranger, cl, ca_only)
            assert {k: out[k] for k in calls} == {k: "UNAVAILABLE" for k in calls}
        _unchanged(cl, before)
        # The public API still serves users, with the cluster's own members behind it.
        assert c.generate(make_request(PROMPT, max_tokens=8)).finish_reason == "length"
        cl.wait_idle()


def test_security_none_is_explicit_and_open(stories_path, stranger, caplog):
    """`none` is what the report found: a stranger's Decode call reserves blocks. It must be asked for."""
    cfg = make_config(stories_path, **{"security.mode": "none"})
    with InProcessCluster(cfg) as cl:
        out = run_stranger(stranger, cl)
        assert out["decode"].startswith("OK") and out["heartbeat"].startswith("OK")
    assert any("security.mode is none" in r.getMessage() for r in caplog.records)


def _reserve(cl: InProcessCluster, rid: str, prompt: list[int], key: bytes):
    """Play the router (it holds the cluster secret): open a reservation with transfer key `key`."""
    identity = cl.core.identity
    dec = next(w for w in cl.core.members.workers.values() if w.role == "decode")
    ch = identity.channel(dec.address)
    call = wrpc.DecodeWorkerStub(ch).Decode(wpb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, transfer_timeout_s=20, transfer_key=key,
        sampling=params_to_proto(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))),
        metadata=identity.metadata, timeout=60)
    assert next(call).reservation.ok
    return dec, ch, call


def test_a_reservation_for_imported_kv_needs_a_key(stories_path):
    cfg = make_config(stories_path)
    with InProcessCluster(cfg) as cl:
        with pytest.raises(grpc.RpcError) as ei:
            _reserve(cl, "nokey-1", [1, 403, 407], b"")
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "transfer_key" in ei.value.details()
        cl.wait_idle()


def _prefill(cl: InProcessCluster, worker_id: str, rid: str, prompt: list[int], dec, key: bytes) -> None:
    identity = cl.core.identity
    pw = cl.core.members.workers[worker_id]
    with identity.channel(pw.address) as ch:
        stream = wrpc.PrefillWorkerStub(ch).Prefill(wpb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, decode_transfer_address=dec.transfer_address,
            transfer_timeout_s=20, transfer_key=key,
            sampling=params_to_proto(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))),
            metadata=identity.metadata, timeout=60)
        list(stream)  # ends when the shipping ends


def _forge(dec, rid: str, layout, n_blocks: int, key: bytes | None, transport: str):
    """Garbage KV with correct checksums (a stranger can compute xxh3 too), signed or not."""
    frame = memoryview(bytes([7]) * (layout.block_nbytes * n_blocks))
    header = build_header(rid, layout.dtype, list(layout.block_shape), layout.block_nbytes, [None] * n_blocks,
                          [frame], [n_blocks], meta={"attempt": 0, "first_token": 5, "first_logprob": 0.0})
    return send_once(transport, dec.transfer_address, header, [frame], key=key)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_only_the_chosen_prefill_worker_can_write_a_reservation(stories_path, transport):
    eng = LLMEngine(EngineConfig(model=stories_path))
    prompt = eng.tokenizer.encode(PROMPT)
    ref = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]["token_ids"]
    cfg = make_config(stories_path, **{"transfer.transport": transport, "prefill.replicas": 2})
    with InProcessCluster(cfg) as cl:
        key, other = b"K" * 32, b"O" * 32
        dec, ch, call = _reserve(cl, "victim-1", prompt, key)
        layout = next(rt for rt in cl.runtimes() if rt.role == "decode").engine.kv_layout
        n_blocks = -(-len(prompt) // layout.block_shape[2])
        # Forged KV straight to the KV port, checksums right: unsigned, then under a guessed key.
        for guess in (None, b"G" * 32):
            h = _forge(dec, "victim-1", layout, n_blocks, guess, transport)
            assert h.state is TransferState.FAILED and "not signed with the reservation's transfer key" in h.error
        # A real prefill worker the router did not choose for this reservation: it holds another key,
        # and its shipment is refused (it computes the same KV, so only the refusal tells).
        wrong = next(rt for rt in cl.runtimes() if rt.worker_id == "prefill-1").service
        _prefill(cl, "prefill-1", "victim-1", prompt, dec, other)
        assert wrong.bytes_sent == 0
        # The chosen one: its KV lands and the stream is the engine's own, token for token.
        _prefill(cl, "prefill-0", "victim-1", prompt, dec, key)
        tokens = []
        for msg in call:
            tokens += msg.tokens.token_ids if msg.HasField("tokens") else []
        ch.close()
        # The first token came from the prefill worker; the decode worker continues from the KV.
        assert tokens == ref[1:], "KV that landed was not the chosen prefill worker's"
        with cl.client() as c:  # and the decode worker's prefix cache holds nothing forged
            assert c.generate(make_request(prompt, max_tokens=12, ignore_eos=True)).token_ids == ref
        cl.wait_idle()


def test_curve_encrypts_kv_and_refuses_plain_senders(stories_path):
    """transfer.curve: the decode worker's KV port speaks only CURVE; its public key reaches the
    prefill worker through the router, and the cluster's output is unchanged."""
    eng = LLMEngine(EngineConfig(model=stories_path))
    ref = eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]["token_ids"]
    cfg = make_config(stories_path, **{"transfer.curve": True})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        dec = next(w for w in cl.core.members.workers.values() if w.role == "decode")
        assert len(dec.transfer_public_key) == 40  # Z85 of a 32-byte key, from the registration
        out = c.generate(make_request(PROMPT, max_tokens=12))
        assert out.token_ids == ref and out.usage["kv_transfer_bytes"] > 0
        # A sender without CURVE gets no connection at all: its transfer is never acknowledged.
        layout = next(rt for rt in cl.runtimes() if rt.role == "decode").engine.kv_layout
        frame = memoryview(bytes(layout.block_nbytes))
        header = build_header("plain-1", layout.dtype, list(layout.block_shape), layout.block_nbytes, [None],
                              [frame], [1], meta={"attempt": 0})
        h = send_once("zmq", dec.transfer_address, header, [frame], timeout_s=1.5)
        assert h.state is TransferState.FAILED and "no acknowledgement" in h.error
        cl.wait_idle()


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_mtls_cluster_generates_streams_and_cancels(stories_path, tmp_path, transport):
    eng = LLMEngine(EngineConfig(model=stories_path))
    ref = eng.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0))[0]["token_ids"]
    cfg = make_config(stories_path, **{"transfer.transport": transport, "security.mode": "mtls",
                                       "security.certs_dir": str(make_certs(tmp_path / "certs"))})
    with InProcessCluster(cfg) as cl, cl.client() as c:
        assert c.generate(make_request(PROMPT, max_tokens=16)).token_ids == ref
        streamed = []
        for msg in c.stream(make_request(PROMPT, max_tokens=16)):
            streamed += msg.token_ids
        assert streamed == ref
        stream = c.stream(make_request(PROMPT, max_tokens=400, ignore_eos=True))
        next(stream)
        stream.cancel()  # the client goes away mid-stream: everything it held is freed
        cl.wait_idle()


def test_a_world_readable_ray_token_file_is_made_private(tmp_path, monkeypatch):
    """What a cluster's start does to the token file Ray made (RAY_AUTH_TOKEN_PATH here)."""
    import stat

    from pdserve.launch.cluster import _keep_ray_token_private

    token = tmp_path / "auth_token"
    token.write_text("t")
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    _keep_ray_token_private()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


@pytest.mark.parametrize("source", ["env", "path", "default", "none", "mode_set"])
def test_a_joining_driver_takes_token_mode_where_ray_start_would(source, tmp_path, monkeypatch):
    """`ray start` turns token auth on when RAY_AUTH_TOKEN, the file at RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token holds a token; a driver joining that cluster must ask for token mode too."""
    from pdserve.launch.cluster import _join_with_token_if_ray_would

    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        # Set first, so that the mode the function sets is undone after the test even where the
        # variable was unset (delenv of an unset variable records nothing to put back).
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    if source == "env":
        monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    elif source == "path":
        (tmp_path / "elsewhere").write_text("t")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "elsewhere"))
    elif source in ("default", "mode_set"):
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("t")
    if source == "mode_set":
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice stands
    _join_with_token_if_ray_would()
    want = {"none": None, "mode_set": "disabled"}.get(source, "token")
    assert os.environ.get("RAY_AUTH_MODE") == want
