"""What fault tolerance trusts (trainer/resilience/trust.py): heals between replica groups are
authenticated with the job's secret and loaded weights-only; quorum members outside the job are
refused by name.

* a rogue server answering a heal (no tag, a wrong tag, a correct tag from a group id outside the
  job, a crafted pickle whose ``__reduce__`` creates a file): refused, naming the source; the file
  never appears (the same payload loaded the way torchft's HTTPTransport loads it does create it);
* a request without the secret (or with a wrong tag, or replayed) gets no byte of state (measured
  on the server), a tagged one gets it all; the server listens on the announced address only;
* a process joining the lighthouse under a replica id outside the job, at a higher step: the
  quorum is refused naming it, and nothing is fetched from it or loaded;
* the secret file: created with mode 600; a group without it, or with a readable one, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from models.errors import ConfigError

pytest.importorskip("torchft")

from trainer.resilience.trust import (  # noqa: E402
    SECRET_ENV,
    AuthenticatedTransport,
    UntrustedPeerError,
    new_secret,
    read_secret,
)

SECRET = secrets.token_bytes(32)
TIMEOUT = timedelta(seconds=10)


class _Evil:
    """A pickle that creates ``path`` when unpickled by anything that calls what it names."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rogue(answers: list[tuple[str, bytes]]) -> tuple[ThreadingHTTPServer, str]:
    """An HTTP server on localhost answering the i-th request with ``answers[i]`` = (claimed group, body)."""
    served = iter(answers)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            source, body = next(served)
            self.send_response(200)
            self.send_header("X-Meshwright-From", source)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/heal/"


def _tagged(body: bytes, secret: bytes, source: int, step: int, nonce: str) -> bytes:
    mac = hmac.new(secret, f"meshwright-heal-response|{step}|{source}|{nonce}|".encode(), hashlib.sha256)
    mac.update(body)
    return body + mac.digest()


def test_rogue_heal_answers_are_refused(tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    evil = _saved({"user": {"meshwright": _Evil(marker)}, "torchft": {"step": 9}})
    receiver = AuthenticatedTransport(
        secret=SECRET, group_id=1, num_groups=2, timeout=TIMEOUT, address="127.0.0.1"
    )

    # A rogue that knows the secret (a compromised group) tags its answer for the request's fresh nonce.
    class Insider(BaseHTTPRequestHandler):  # holds the secret, answers with the crafted pickle
        source = "0"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            nonce = self.path.rsplit("nonce=", 1)[1]
            self.send_response(200)
            body = _tagged(evil, SECRET, int(self.source), 9, nonce)
            self.send_header("X-Meshwright-From", self.source)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server, url = _rogue(
        [("0", evil), ("0", _tagged(evil, secrets.token_bytes(32), 0, 9, "0" * 32)), ("0", evil + b"\0" * 32)]
    )
    insider = ThreadingHTTPServer(("127.0.0.1", 0), Insider)
    threading.Thread(target=insider.serve_forever, daemon=True).start()
    insider_url = f"http://127.0.0.1:{insider.server_address[1]}/heal/"
    try:
        cases = {
            "missing tag": (url, "wrong or missing authentication tag"),
            "wrong secret": (url, "wrong or missing authentication tag"),
            "zero tag": (url, "wrong or missing authentication tag"),
            "crafted pickle, valid tag": (insider_url, "holds 'io.open', not an allowed global"),
        }
        for case, (source, expected) in cases.items():
            with pytest.raises(UntrustedPeerError) as err:
                receiver.recv_checkpoint(src_rank=0, metadata=source, step=9, timeout=TIMEOUT)
            message = str(err.value)
            assert expected in message and source in message and "quorum rank 0" in message, (case, message)
            assert not os.path.exists(marker), case
            print(f"{case}: {message}")
        Insider.source = "7"  # a valid tag, but no group of this job (2 groups): unknown sender
        with pytest.raises(UntrustedPeerError, match="claims replica group 7.*not another replica group"):
            receiver.recv_checkpoint(src_rank=0, metadata=insider_url, step=9, timeout=TIMEOUT)
        with pytest.raises(UntrustedPeerError, match="not a meshwright heal address"):
            receiver.recv_checkpoint(src_rank=0, metadata="file:///etc/passwd#", step=9, timeout=TIMEOUT)
    finally:
        server.shutdown()
        insider.shutdown()
        receiver.shutdown()
    assert not os.path.exists(marker)
    # The payload is live: loaded as torchft's HTTPTransport loads a heal (weights_only=False), it runs.
    torch.load(io.BytesIO(evil), weights_only=False)
    assert os.path.exists(marker)


def test_request_without_the_secret_gets_no_state() -> None:
    source = AuthenticatedTransport(
        secret=SECRET, group_id=0, num_groups=2, timeout=TIMEOUT, address="localhost"
    )
    receiver = AuthenticatedTransport(
        secret=SECRET, group_id=1, num_groups=2, timeout=TIMEOUT, address="localhost"
    )
    try:
        assert source.bound[0] == "127.0.0.1", source.bound  # the announced address, not 0.0.0.0 / ::
        weights = torch.randn(256, 1024)
        state = {
            "user": {"meshwright": {"w": weights, "lr": [0.1, (0.9, 0.95)], "step": 5}},
            "torchft": {"step": 5},
        }
        source.send_checkpoint(dst_ranks=[1], step=5, state_dict=state, timeout=TIMEOUT)
        base = source.metadata()
        nonce = "ab" * 16
        good_tag = hmac.new(
            SECRET, f"meshwright-heal-request|5|1|{nonce}".encode(), hashlib.sha256
        ).hexdigest()
        received = {}
        for case, headers in {
            "no tag": {},
            "wrong tag": {"X-Meshwright-Tag": hmac.new(b"x" * 32, b"y", hashlib.sha256).hexdigest()},
            "tag of another step": {
                "X-Meshwright-Tag": hmac.new(
                    SECRET, f"meshwright-heal-request|4|1|{nonce}".encode(), hashlib.sha256
                ).hexdigest()
            },
        }.items():
            request = urllib.request.Request(f"{base}5?group=1&nonce={nonce}", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=10)
            assert err.value.code == 403, case
            received[case] = len(err.value.read())
        assert source.served_bytes == 0, source.served_bytes
        print(f"refused requests: bytes received {received}, state bytes served {source.served_bytes}")
        got = receiver.recv_checkpoint(src_rank=0, metadata=base, step=5, timeout=TIMEOUT)
        assert torch.equal(got["user"]["meshwright"]["w"], weights)
        assert got["user"]["meshwright"]["lr"] == [0.1, (0.9, 0.95)]
        served = source.served_bytes
        assert served > weights.numel() * 4
        # The same (valid) request again: a replay is refused, nothing more is served.
        request = urllib.request.Request(
            f"{base}5?group=1&nonce={nonce}", headers={"X-Meshwright-Tag": good_tag}
        )
        with urllib.request.urlopen(request, timeout=10) as response:  # first use of this nonce: served
            assert len(response.read()) > weights.numel() * 4
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 403 and b"replayed" in err.value.read()
        print(
            f"authenticated heal: {served} state bytes served; refusals: {[why for _, why in source.refused]}"
        )
        source.disallow_checkpoint()
    finally:
        source.shutdown()
        receiver.shutdown()


def test_outsider_in_quorum_is_not_a_recovery_source() -> None:
    """A process joins the lighthouse as ``intruder`` at step 100 (the others are at 0, so torchft
    would make it everyone's recovery source): replica group 1's quorum is refused, naming it, and
    nothing is fetched or loaded."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseClient, LighthouseServer
    from torchft.process_group import ProcessGroupGloo

    from trainer.resilience.fault_tolerance import make_manager

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        group_id=1,
        num_groups=2,
        secret=SECRET,
        timeout=TIMEOUT,
        min_replica_size=2,
        quorum_timeout=timedelta(seconds=20),
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        heartbeat_interval=timedelta(milliseconds=100),
        store_addr="localhost",
        store_port=store.port,
    )
    loaded: list[object] = []
    fetched: list[str] = []
    manager.register_state_dict_fn("meshwright", loaded.append, lambda: {"w": torch.zeros(2)})
    transport = manager._checkpoint_transport
    transport.recv_checkpoint = lambda *a, **k: fetched.append(str(a or k))  # type: ignore[method-assign]
    client = LighthouseClient(lighthouse.address(), connect_timeout=TIMEOUT)
    stop = threading.Event()

    def intruder() -> None:
        def beat() -> None:
            while not stop.is_set():
                client.heartbeat("intruder:1")
                time.sleep(0.1)

        threading.Thread(target=beat, daemon=True).start()
        client.quorum(
            replica_id="intruder:1",
            timeout=timedelta(seconds=20),
            address="http://127.0.0.1:9",
            store_address="127.0.0.1:9",
            step=100,
            world_size=1,
            shrink_only=False,
        )

    thread = threading.Thread(target=intruder, daemon=True)
    thread.start()
    try:
        with pytest.raises(UntrustedPeerError) as err:
            manager.start_quorum()
        message = str(err.value)
        print(message)
        assert "['intruder:1'] are not replica groups of this job" in message
        assert "'intruder:1' as the recovery source" in message  # torchft's choice, refused
        assert fetched == [] and loaded == []
        assert manager.current_step() == 0
    finally:
        stop.set()
        thread.join(timeout=20)
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_secret_file(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "secret")
    new_secret(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(read_secret(path)) == 32
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"\\${SECRET_ENV} is not set: start the groups with FT_GROUPS=N"):
        read_secret()
    os.chmod(path, 0o644)
    monkeypatch.setenv(SECRET_ENV, path)
    with pytest.raises(ConfigError, match="mode 644.*chmod 600"):
        read_secret()
    # A trainer group started with fault tolerance on and no secret: refused before any process group.
    from trainer.config import compose_config
    from trainer.resilience.fault_tolerance import check_environment

    cfg = compose_config(
        "+experiment=debug",
        "parallelism.dp_replicate=2",
        "parallelism.fault_tolerance.enable=true",
        "parallelism.fault_tolerance.lighthouse=http://localhost:1",
    )
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        check_environment(cfg)


def test_rogue_torchft_manager_cannot_heal_a_group(tmp_path) -> None:
    """The realistic attack: a stock torchft Manager (its default HTTPTransport) joins as
    ``replica_group_0`` (a self-declared name passes the membership check) at step 100, serving a
    pickle whose ``__reduce__`` creates a file. Replica group 1 (ours, step 0) is told to heal from it:
    the answer is refused naming the source, the file never appears, nothing is loaded, and the
    refusal is what ``Manager.errored()`` reports (the trainer stops on it)."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft._torchft import LighthouseServer
    from torchft.process_group import ProcessGroupGloo

    from trainer.resilience.fault_tolerance import make_manager

    marker = str(tmp_path / "pwned")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    common = dict(
        min_replica_size=2,
        quorum_timeout=timedelta(seconds=20),
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        heartbeat_interval=timedelta(milliseconds=100),
        store_addr="localhost",
    )
    ours = make_manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        group_id=1,
        num_groups=2,
        secret=SECRET,
        timeout=TIMEOUT,
        store_port=stores[1].port,
        **common,  # type: ignore[arg-type]
    )
    rogue = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=None,
        state_dict=None,
        use_async_quorum=False,
        timeout=TIMEOUT,
        replica_id="replica_group_0",
        init_sync=False,
        store_port=stores[0].port,
        **common,  # type: ignore[arg-type]
    )
    loaded: list[object] = []
    ours.register_state_dict_fn("meshwright", loaded.append, lambda: {"w": torch.zeros(2)})
    rogue.register_state_dict_fn("meshwright", lambda sd: None, lambda: {"w": _Evil(marker)})
    rogue.load_state_dict({"step": 100, "batches_committed": 0})
    thread = threading.Thread(target=rogue.start_quorum, daemon=True)
    thread.start()
    try:
        t0 = time.perf_counter()
        ours.start_quorum()
        print(f"quorum + refused heal: {time.perf_counter() - t0:.2f}s")
        error = ours.errored()
        assert error is not None
        refusal = error.original_exception
        print(refusal)
        assert isinstance(refusal, UntrustedPeerError), refusal
        # torchft's transport announces its own address (http://<host>:<port>/checkpoint/): refused
        # before any request is sent to it, naming it.
        assert "refusing to heal from quorum rank 0: it announced 'http://" in str(refusal)
        assert "/checkpoint/', not a meshwright heal address" in str(refusal)
        assert not os.path.exists(marker) and loaded == []
    finally:
        thread.join(timeout=30)
        for manager in (ours, rogue):
            manager.shutdown(wait=False)
        lighthouse.shutdown()
