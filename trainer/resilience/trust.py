"""What fault tolerance trusts: the job's secret, the healing transport, the quorum's members.

torchft 0.2.0's defaults trust the network: its ``HTTPTransport`` serves a group's whole training
state to whoever asks, on every interface, and the healing group unpickles the answer with
``weights_only=False`` (code execution for whatever answers); the lighthouse lets any process join
the quorum under any replica id and become every group's recovery source. Here instead:

* **the job's secret**: the launchers (``FT_GROUPS=N ./launch.sh``, ``FT=1 sbatch``, through
  ``trainer/resilience/supervisor.py``) create 32 random bytes in a file of mode 0600 (readable by the
  job's user only) and hand its path to every group in ``$MESHWRIGHT_FT_SECRET_FILE``
  (:func:`new_secret`, :func:`read_secret`). A group started without it refuses to start.
* **the healing transport** (:class:`AuthenticatedTransport`, torchft's ``CheckpointTransport``
  interface): the server listens on the node's announced address only (``$MESHWRIGHT_FT_ADDRESS``,
  set by the launchers), answers only requests whose HMAC-SHA256 tag (over the step, the asking
  group and a fresh nonce) verifies under the secret (anything else gets a 403 and no byte of
  state), and tags its answer (over the step, the asking request's nonce, the serving group and the
  whole payload). The receiver checks that tag before it parses a byte, then loads the payload with
  ``torch.load(weights_only=True)`` (tensors and plain Python values; the same allow-list as DCP
  BYTES entries in ``trainer/checkpoint/reader.py``). A refusal is an :class:`UntrustedPeerError`
  naming the source; the healing group keeps its state and stops (its supervisor restarts it).
* **the quorum's members** (:class:`MemberCheckingClient`): every member of a quorum must carry the
  replica id of one of the job's groups (``replica_group_<g>``, ``g < dp_replicate``); a quorum with
  any other member is refused, naming it, before torchft configures a process group or picks a
  recovery source from it.

Not protected (README "What fault tolerance trusts"): the gradient traffic of the cross-group
process group (gloo/NCCL, no authentication), the lighthouse and torchft's manager server (their
gRPC has no credential: a process that reaches them can disturb quorums, never read or write
state), and the confidentiality of a heal on the wire (authenticated, not encrypted).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import re
import secrets
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, TYPE_CHECKING, Optional, cast

import torch
from torchft.checkpointing.transport import CheckpointTransport

from models.errors import ConfigError

if TYPE_CHECKING:
    from torchft._torchft import ManagerClient, QuorumResult

State = dict[str, object]  # torchft's healing payload: {"user": {...}, "torchft": {...}}

SECRET_ENV = "MESHWRIGHT_FT_SECRET_FILE"
ADDRESS_ENV = "MESHWRIGHT_FT_ADDRESS"
SECRET_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size
REPLICA_PREFIX = "replica_group_"
_TAG_HEADER = "X-Meshwright-Tag"
_CHUNK_BYTES = 1 << 22
_MAX_BYTES = 1 << 40  # what a heal answer may announce (1 TiB: a rank's state is far smaller)
_FROM_HEADER = "X-Meshwright-From"
_PATH = re.compile(r"^/heal/(\d+)\?group=(\d+)&nonce=([0-9a-f]{32})$")
_METADATA = re.compile(r"^http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._\-]+):(\d+)/heal/$")
_FIX = (
    "start the groups with FT_GROUPS=N ./launch.sh or FT=1 sbatch slurm/train.sbatch (they create the "
    "job's secret), or create one with `python -m trainer.resilience.trust new-secret PATH` and export "
    f"{SECRET_ENV}=PATH in every group"
)


class UntrustedPeerError(RuntimeError):
    """A peer's heal answer, request or quorum membership was refused (no byte of it was loaded)."""


# -- the job's secret ------------------------------------------------------------------------------
def new_secret(path: str) -> None:
    """Write a fresh secret to ``path``, readable and writable by this user only (mode 0600, created
    so: never readable by others, even for an instant), replacing any older one atomically."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_secret(path: Optional[str] = None) -> bytes:
    """The job's secret from ``path`` (default ``$MESHWRIGHT_FT_SECRET_FILE``); a missing, short, or
    group/other-accessible file is a ConfigError naming the fix."""
    path = path or os.environ.get(SECRET_ENV)
    if not path:
        raise ConfigError(
            "parallelism.fault_tolerance.enable=true needs the job's secret (it authenticates heals between "
            f"replica groups), but ${SECRET_ENV} is not set: {_FIX}."
        )
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError as e:
        raise ConfigError(f"${SECRET_ENV}={path}: cannot read the job's secret ({e}); {_FIX}.") from None
    if stat.S_IMODE(info.st_mode) & 0o077 or info.st_uid != os.getuid():
        raise ConfigError(
            f"${SECRET_ENV}={path} has mode {stat.S_IMODE(info.st_mode):o} (owner uid {info.st_uid}): the "
            f"job's secret must belong to this user (uid {os.getuid()}) with mode 600; `chmod 600 {path}` or "
            f"{_FIX}."
        )
    try:
        secret = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) < SECRET_BYTES:
        raise ConfigError(
            f"${SECRET_ENV}={path} does not hold a secret of {SECRET_BYTES} random bytes in hex; {_FIX}."
        )
    return secret


def announced_address() -> str:
    """The address this node's heal server binds and announces (``$MESHWRIGHT_FT_ADDRESS``, set by the
    launchers; localhost when unset: a group started by hand serves its own machine only)."""
    return os.environ.get(ADDRESS_ENV) or "localhost"


# -- quorum membership -------------------------------------------------------------------------------
def replica_id(group_id: int) -> str:
    return f"{REPLICA_PREFIX}{group_id}"


def outsiders(replica_ids: list[str], num_groups: int) -> list[str]:
    """The quorum members whose replica id (torchft's ``<id>:<uuid>``) is none of the job's groups."""
    job = {replica_id(g) for g in range(num_groups)}
    return [r for r in replica_ids if r.split(":", 1)[0] not in job]


class MemberCheckingClient:
    """torchft's ``ManagerClient`` whose quorum answer is refused when a member is not one of the
    job's groups: the member is named, and torchft never configures a process group with it nor
    fetches a checkpoint from it (``Manager._async_quorum`` raises before either)."""

    def __init__(self, client: ManagerClient, num_groups: int, group_id: int) -> None:
        self._client = client
        self._num_groups = num_groups
        self._group_id = group_id

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int,
        init_sync: bool = True,
    ) -> QuorumResult:
        quorum = self._client._quorum(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            timeout=timeout,
            commit_failures=commit_failures,
            init_sync=init_sync,
        )
        strangers = outsiders(list(quorum.replica_ids), self._num_groups)
        if strangers:
            source = quorum.recover_src_replica_rank
            src = quorum.replica_ids[source] if quorum.heal and source is not None else None
            raise UntrustedPeerError(
                f"replica group {self._group_id}: refusing quorum {quorum.quorum_id}: member(s) {strangers} "
                f"are not replica groups of this job ({replica_id(0)}..{replica_id(self._num_groups - 1)})"
                + (f"; it named {src!r} as the recovery source" if src else "")
                + "; no state is sent to or taken from them"
            )
        return quorum

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self._client._checkpoint_metadata(rank, timeout=timeout)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return self._client.should_commit(group_rank, step, should_commit, timeout=timeout)


# -- the healing transport ---------------------------------------------------------------------------
def _request_tag(secret: bytes, step: int, group: int, nonce: str) -> str:
    return hmac.new(
        secret, f"meshwright-heal-request|{step}|{group}|{nonce}".encode(), hashlib.sha256
    ).hexdigest()


def _response_mac(secret: bytes, step: int, source: int, nonce: str) -> hmac.HMAC:
    return hmac.new(secret, f"meshwright-heal-response|{step}|{source}|{nonce}|".encode(), hashlib.sha256)


def _to_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class _MacWriter:
    """A write-only stream that feeds an HMAC and the socket (either optional), counting the bytes."""

    def __init__(self, out: Optional[io.BufferedIOBase], mac: Optional[hmac.HMAC]) -> None:
        self.out, self.mac, self.bytes = out, mac, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self.mac is not None:
            self.mac.update(view)
        if self.out is not None:
            self.out.write(view)
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        if self.out is not None:
            self.out.flush()


class _BufferReader(io.RawIOBase):
    """A seekable reader over a buffer, for ``torch.load`` without copying the buffer into a BytesIO."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = min(max(base + offset, 0), len(self._view))
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


def _saved_size(state: object) -> int:
    """Bytes ``torch.save(state)`` writes (a dry run that keeps nothing: the storages are not copied)."""
    counter = _MacWriter(None, None)
    torch.save(state, cast(IO[bytes], counter))
    return counter.bytes


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


class AuthenticatedTransport(CheckpointTransport[State]):
    """torchft ``CheckpointTransport`` for heals between the job's replica groups: HTTP on the node's
    announced address, HMAC-SHA256 under the job's secret both ways, weights-only loading.

    ``served_bytes`` counts the state bytes this server sent (the payload of authenticated answers);
    ``refused`` lists the requests it turned away, as (client address, reason)."""

    def __init__(
        self,
        *,
        secret: bytes,
        group_id: int,
        num_groups: int,
        timeout: timedelta,
        address: Optional[str] = None,
    ) -> None:
        self._secret = secret
        self._group_id = group_id
        self._num_groups = num_groups
        self._timeout = timeout
        self._cond = threading.Condition()
        self._step = -1
        self._state: Optional[object] = None
        self._size = 0
        self._allowed = False
        self._readers = 0
        self._nonces: set[str] = set()
        self.served_bytes = 0
        self.refused: list[tuple[str, str]] = []
        host = address or announced_address()
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        transport = self
        request_timeout = timeout.total_seconds()

        class Server(_Server):
            address_family = family

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout  # a stalled client cannot hold a server thread forever

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
                pass

            def do_GET(self) -> None:
                transport._serve(self)

        self._server = Server((str(sockaddr[0]), int(sockaddr[1])), Handler)
        bound = self._server.socket.getsockname()
        self._host = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
        self._port = bound[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="meshwright-heal", daemon=True
        )
        self._thread.start()

    @property
    def bound(self) -> tuple[str, int]:
        """(address, port) the server listens on."""
        return self._host, self._port

    def metadata(self) -> str:
        return f"http://{self._host}:{self._port}/heal/"

    # -- serving --------------------------------------------------------------------------------
    def _refuse(self, handler: BaseHTTPRequestHandler, code: int, why: str) -> None:
        self.refused.append((handler.client_address[0], why))
        body = f"refused: {why}\n".encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        found = _PATH.match(handler.path)
        if found is None:
            return self._refuse(handler, 404, f"unknown request {handler.path[:100]!r}")
        step, group, nonce = int(found.group(1)), int(found.group(2)), found.group(3)
        tag = handler.headers.get(_TAG_HEADER, "")
        if not hmac.compare_digest(tag.encode(), _request_tag(self._secret, step, group, nonce).encode()):
            return self._refuse(
                handler, 403, f"wrong or missing {_TAG_HEADER} (not signed with the job's secret)"
            )
        with self._cond:
            if nonce in self._nonces:
                return self._refuse(handler, 403, "replayed request (nonce already answered)")
            self._nonces.add(nonce)
            if not 0 <= group < self._num_groups:
                return self._refuse(handler, 403, f"group {group} is not a replica group of this job")
            deadline = time.monotonic() + self._timeout.total_seconds()
            while not (self._allowed and self._step == step):  # the source may not have staged it yet
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._refuse(handler, 409, f"serving step {self._step}, asked for step {step}")
                self._cond.wait(left)
            self._readers += 1
            state = self._state
            size = self._size
        mac = _response_mac(self._secret, step, self._group_id, nonce)
        writer = _MacWriter(handler.wfile, mac)
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header(_FROM_HEADER, str(self._group_id))
            handler.send_header("Content-Length", str(size + TAG_BYTES))
            handler.end_headers()
            torch.save(state, cast(IO[bytes], writer))
            handler.wfile.write(mac.digest())
        finally:
            with self._cond:
                self.served_bytes += writer.bytes
                self._readers -= 1
                self._cond.notify_all()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: State, timeout: timedelta) -> None:
        """Serve ``state_dict`` (its tensors on the CPU) for ``step`` until :meth:`disallow_checkpoint`."""
        state = _to_cpu(state_dict)
        size = _saved_size(state)  # the answers' Content-Length: the receiver reads into one buffer
        with self._cond:
            self._state, self._step, self._size, self._allowed = state, step, size, True
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving; returns once the answers in flight are written (the state may change after)."""
        with self._cond:
            self._allowed = False
            while self._readers:
                self._cond.wait()
            self._state = None

    # -- receiving ------------------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> State:
        """Fetch and check the state of ``step`` from the group that announced ``metadata``; an
        UntrustedPeerError (naming it) unless the answer is tagged with the job's secret by one of the
        job's other groups and loads with ``torch.load(weights_only=True)``."""
        me = f"replica group {self._group_id}"
        if _METADATA.match(metadata) is None:
            raise UntrustedPeerError(
                f"{me}: refusing to heal from quorum rank {src_rank}: it announced {metadata[:200]!r}, "
                "not a meshwright heal address (http://host:port/heal/)"
            )
        nonce = secrets.token_hex(16)
        url = f"{metadata}{step}?group={self._group_id}&nonce={nonce}"
        request = urllib.request.Request(
            url, headers={_TAG_HEADER: _request_tag(self._secret, step, self._group_id, nonce)}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                source = response.headers.get(_FROM_HEADER, "")
                origin = f"{metadata} (quorum rank {src_rank}, claims replica group {source or '?'})"
                if (
                    not source.isdigit()
                    or not 0 <= int(source) < self._num_groups
                    or int(source) == self._group_id
                ):
                    raise UntrustedPeerError(
                        f"{me}: refusing the heal answer of {origin}: not another replica group of this job"
                    )
                length = response.headers.get("Content-Length", "")
                if not length.isdigit() or not TAG_BYTES <= int(length) <= _MAX_BYTES:
                    raise UntrustedPeerError(
                        f"{me}: refusing the heal answer of {origin}: Content-Length {length[:30]!r} is "
                        f"not a size in [{TAG_BYTES}, {_MAX_BYTES}]"
                    )
                # One buffer; the payload is hashed chunk by chunk as it arrives, the tag is its last bytes.
                mac = _response_mac(self._secret, step, int(source), nonce)
                body = bytearray(int(length))
                received = 0
                with memoryview(body) as view:
                    while received < len(body):
                        got = response.readinto(view[received : received + _CHUNK_BYTES])
                        if not got:
                            break
                        mac.update(view[received : min(received + got, len(body) - TAG_BYTES)])
                        received += got
                if received < len(body):
                    raise UntrustedPeerError(
                        f"{me}: the heal answer of {origin} ended after {received} of {len(body)} bytes"
                    )
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            raise RuntimeError(
                f"{me}: heal from {metadata} (quorum rank {src_rank}) failed: {e.code} {detail}"
            ) from None
        if len(body) < TAG_BYTES or not hmac.compare_digest(bytes(body[-TAG_BYTES:]), mac.digest()):
            raise UntrustedPeerError(
                f"{me}: refusing the heal answer of {origin}: wrong or missing authentication tag (not "
                f"signed with the job's secret for step {step}); nothing of its {len(body)} bytes was loaded"
            )
        del body[-TAG_BYTES:]
        try:
            with _BufferReader(body) as reader:
                state = torch.load(cast(IO[bytes], reader), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL (\S+)", str(e))
            what = f"'{found.group(1)}'" if found else "a value"
            raise UntrustedPeerError(
                f"{me}: refusing the heal answer of {origin}: it holds {what}, not an allowed global of "
                "torch.load(weights_only=True) (tensors and plain Python values only); nothing was run"
            ) from None
        if not isinstance(state, dict) or not isinstance(state.get("user"), dict) or "torchft" not in state:
            raise UntrustedPeerError(f"{me}: refusing the heal answer of {origin}: not a torchft state dict")
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "new-secret":
        raise SystemExit("usage: python -m trainer.resilience.trust new-secret PATH")
    new_secret(argv[1])
    print(argv[1])


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
