"""A stranger on the cluster's network: it has the .proto files (compiled by the test into its own
folder as the package stranger_api) and nothing else of pdserve, and no cluster secret. It replays the
attacks of issue #9 and prints, as JSON, how each call ended.

usage: stranger.py CONTROL PREFILL DECODE [CERTS_DIR]
With CERTS_DIR it talks TLS: with a certificate of its own CA, or (a folder with only ca.pem) with
the cluster's public CA certificate and no client certificate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
from stranger_api.v1 import router_pb2 as pb  # the stranger's own code, generated from proto/
from stranger_api.v1 import worker_pb2 as wpb
from stranger_api.v1 import worker_pb2_grpc as wrpc

HERE = Path(__file__).resolve().parent
assert Path(wpb.__file__).resolve().is_relative_to(HERE), f"not the stranger's own code: {wpb.__file__}"


def channel(address: str, certs: Path | None) -> grpc.Channel:
    if certs is None:
        return grpc.insecure_channel(address)
    if not (certs / "node.pem").exists():  # the cluster's CA certificate (public) but no certificate of its own
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    else:
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "node.key").read_bytes(),
                                             (certs / "node.pem").read_bytes())
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "pdserve-cluster")])


def outcome(fn) -> str:
    try:
        result = fn()
        if hasattr(result, "__next__"):  # a stream: its first message is enough (the work began)
            stream, result = result, next(result)
            stream.cancel()
        return f"OK {str(result)[:200]}"
    except grpc.RpcError as e:
        return e.code().name


def main() -> None:
    control, prefill, decode = sys.argv[1:4]
    certs = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    out = {}
    with channel(control, certs) as ch:
        stub = wrpc.ControlStub(ch)
        fake = wpb.WorkerInfo(worker_id="decode-0", role="decode", address="10.9.9.9:1",
                              transfer_address="tcp://10.9.9.9:2", num_blocks=1 << 20, block_size=16)
        out["register"] = outcome(lambda: stub.Register(fake, timeout=10))
        out["heartbeat"] = outcome(lambda: stub.Heartbeat(wpb.HeartbeatRequest(worker_id="decode-0"), timeout=10))
        out["scale"] = outcome(lambda: stub.Scale(pb.ScaleRequest(pool="decode", replicas=0), timeout=10))
    sampling = pb.SamplingParams(max_tokens=4, temperature=0)
    with channel(prefill, certs) as ch:
        req = wpb.PrefillRequest(request_id="stranger-1", prompt_token_ids=[1, 403, 407, 261, 378], sampling=sampling,
                                 decode_transfer_address="tcp://127.0.0.1:1", transfer_timeout_s=1)
        out["prefill"] = outcome(lambda: wrpc.PrefillWorkerStub(ch).Prefill(req, timeout=10))
    with channel(decode, certs) as ch:
        req = wpb.DecodeRequest(request_id="stranger-2", prompt_token_ids=[1, 403, 407, 261, 378], sampling=sampling,
                                transfer_timeout_s=1, transfer_key=b"s" * 32)
        out["decode"] = outcome(lambda: wrpc.DecodeWorkerStub(ch).Decode(req, timeout=10))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
