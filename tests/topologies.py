"""Servers of a test's own, as production runs them: Redis over TLS, Redis behind
Sentinel, a RabbitMQ node with a TLS listener.

Each starts on free loopback ports with its files (configuration, data, logs, a
self-signed certificate made here with ``openssl``) in a folder of the test's, and
stops with the ``with`` block that started it: nothing here touches the shared
servers on 5432, 3306, 6379 and 5672, nor the shared Erlang port mapper (a RabbitMQ
node here has an ``epmd`` of its own). The programs are Debian's (``scripts/tools.sh``):
a missing one skips the test, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import servers

#: Debian's node script (its /usr/sbin/rabbitmq-server switches to the rabbitmq user).
DEBIAN_RABBITMQ = "/usr/lib/rabbitmq/bin/rabbitmq-server"
#: How long a server may take to accept connections.
START_TIMEOUT = 60.0
#: How long a server may take to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 20.0


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def program(name: str, *places: str) -> str:
    """The path of a Debian program; skip without it (fail in CI)."""
    found = shutil.which(name) or next(
        (p for p in places if os.access(p, os.X_OK)), None
    )
    if found:
        return found
    message = f"{name} is missing: run `bash scripts/tools.sh` (make tools)"
    if servers.in_ci():
        pytest.fail(message)
    pytest.skip(message)


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


@dataclass
class Process:
    """A server process of the test's, its log, and how long it took to start."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    started_in: float = 0.0

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_until(self, ready: Callable[[], bool], began: float) -> None:
        """Wait for ``ready``; fail with the log if the process exits or takes too long."""
        deadline = began + START_TIMEOUT
        while not ready():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.name} did not start:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        self.started_in = time.monotonic() - began

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the process group it leads (it was started alone in it)."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(STOP_TIMEOUT)


def spawn(
    name: str, args: list[str], folder: Path, env: dict[str, str] | None = None
) -> Process:
    log = folder / f"{name}.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            args,
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Process(name, popen, log)


# -- certificates ---------------------------------------------------------------


@dataclass(frozen=True)
class Certificates:
    """A certificate authority of the test's, and a server certificate it signed
    for ``localhost`` and ``127.0.0.1``."""

    ca: Path
    cert: Path
    key: Path


def make_certificates(folder: Path) -> Certificates:
    """Make a CA and a server certificate (EC P-256, valid two days) with openssl."""
    openssl = program("openssl")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, request = (
        folder / "server.pem",
        folder / "server.key",
        folder / "server.csr",
    )
    names = folder / "names.cnf"
    names.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        [
            "req",
            "-x509",
            *ec,
            "-keyout",
            ca_key,
            "-out",
            ca,
            "-days",
            "2",
            "-subj",
            "/CN=celery-outbox test CA",
        ],
        ["req", *ec, "-keyout", key, "-out", request, "-subj", "/CN=localhost"],
        [
            "x509",
            "-req",
            "-in",
            request,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "2",
            "-extfile",
            names,
        ],
    ):
        subprocess.run(
            [openssl, *map(str, args)], check=True, capture_output=True, timeout=30
        )
    for path in (ca, cert, key):
        path.chmod(0o644)  # servers that drop privileges read them too
    return Certificates(ca, cert, key)


# -- Redis ------------------------------------------------------------------------


@dataclass
class Redis:
    """A redis-server of the test's."""

    port: int
    process: Process
    tls: Certificates | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"


def _redis_ready(port: int, tls: Certificates | None) -> Callable[[], bool]:
    import redis

    def ready() -> bool:
        options = {}
        if tls is not None:
            options = {"ssl": True, "ssl_ca_certs": str(tls.ca)}
        client = redis.Redis(port=port, socket_timeout=1, **options)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    return ready


@contextlib.contextmanager
def redis_server(
    folder: Path,
    *,
    tls: Certificates | None = None,
    replica_of: Redis | None = None,
    options: Sequence[str] = (),
) -> Iterator[Redis]:
    """A redis-server without persistence; TLS only (no plain port) with ``tls``; a
    replica of ``replica_of`` (ready once its link to it is up); more ``options``
    (``--name value``) as given."""
    binary = program("redis-server", "/usr/bin/redis-server")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    # No wait for replicas: to catch up on SIGTERM (up to 10 s on Redis 7), nor for
    # more of them to come before a full sync starts (5 s).
    args += ["--shutdown-on-sigterm", "now", "--repl-diskless-sync-delay", "0"]
    args += ["--dir", str(folder), *options]
    ready = _redis_ready(port, tls)
    if replica_of is not None:
        args += ["--replicaof", "127.0.0.1", str(replica_of.port)]
        ready = _replica_ready(port)
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
        args += ["--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key)]
        args += ["--tls-ca-cert-file", str(tls.ca)]
    began = time.monotonic()
    process = spawn("redis", args, folder)
    try:
        process.wait_until(ready, began)
        yield Redis(port, process, tls)
    finally:
        process.stop()


def _replica_ready(port: int) -> Callable[[], bool]:
    import redis

    def ready() -> bool:
        client = redis.Redis(port=port, socket_timeout=1)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    return ready


@dataclass
class Sentinel:
    """A Redis Sentinel of the test's, watching one master."""

    port: int
    master_name: str
    process: Process

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}"

    def _client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def primary_port(self) -> int:
        """The port of the primary Sentinel names now."""
        with self._client() as client:
            return int(client.sentinel_get_master_addr_by_name(self.master_name)[1])

    def fail_over_to(self, replica: Redis) -> float:
        """``SENTINEL FAILOVER`` once Sentinel can promote ``replica``; the seconds
        until Sentinel names it the primary."""
        deadline = time.monotonic() + START_TIMEOUT

        def promotable() -> bool:
            # Known, linked, and recently heard of: Sentinel refuses a failover to
            # a replica it has no fresh INFO from ("NOGOODSLAVE").
            with self._client() as client:
                known = client.sentinel_slaves(self.master_name)
            return any(
                int(entry["port"]) == replica.port
                and entry.get("master-link-status") == "ok"
                and int(entry.get("info-refresh", 10**9)) < 5000
                for entry in known
            )

        while not promotable():
            if time.monotonic() > deadline:
                pytest.fail("Sentinel never found the replica")
            time.sleep(0.05)
        began = time.monotonic()
        with self._client() as client:
            client.execute_command("SENTINEL", "FAILOVER", self.master_name)
        while self.primary_port() != replica.port:
            if time.monotonic() > deadline:
                pytest.fail("Sentinel did not promote the replica")
            time.sleep(0.05)
        return time.monotonic() - began


@contextlib.contextmanager
def redis_sentinel(
    folder: Path, master: Redis, master_name: str, replicas: Sequence[Redis] = ()
) -> Iterator[Sentinel]:
    """``redis-server --sentinel`` (Debian's redis-server 7 has the mode) on ``master``.

    ``replicas`` are named in its file: it asks them at once instead of waiting for
    the master's next report (every 10 s).
    """
    import redis

    binary = program("redis-server", "/usr/bin/redis-server")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = folder / "sentinel.conf"  # Sentinel rewrites its file: it must be its own
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor {master_name} 127.0.0.1 {master.port} 1\n"
        f"sentinel down-after-milliseconds {master_name} 60000\n"
        + "".join(
            f"sentinel known-replica {master_name} 127.0.0.1 {replica.port}\n"
            for replica in replicas
        )
    )

    def ready() -> bool:
        client = redis.Redis(port=port, socket_timeout=1)
        try:
            found = client.sentinel_get_master_addr_by_name(master_name)
            return bool(found) and int(found[1]) == master.port
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    began = time.monotonic()
    process = spawn("sentinel", [binary, str(config), "--sentinel"], folder)
    try:
        process.wait_until(ready, began)
        yield Sentinel(port, master_name, process)
    finally:
        process.stop()


# -- RabbitMQ ----------------------------------------------------------------------


@dataclass
class RabbitNode:
    """A RabbitMQ node of the test's whose only listener is AMQP over TLS."""

    port: int
    process: Process
    tls: Certificates
    #: The node's own Erlang port mapper.
    epmd: Process = field(repr=False)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"


@contextlib.contextmanager
def rabbitmq_tls_node(folder: Path, tls: Certificates) -> Iterator[RabbitNode]:
    """A second RabbitMQ node, alone: its own name, ports, Erlang cookie and port
    mapper, its data and logs in ``folder``, no plugins, and one listener, TLS.

    The distribution (Erlang's node-to-node port) is bound to loopback too.
    """
    binary = DEBIAN_RABBITMQ
    if not os.access(binary, os.X_OK):
        binary = program("rabbitmq-server")
    epmd_binary = program("epmd", "/usr/lib/erlang/bin/epmd")
    folder.mkdir(parents=True, exist_ok=True)
    home = folder / "home"
    home.mkdir(exist_ok=True)
    cookie = home / ".erlang.cookie"
    cookie.write_text(f"outbox-{os.getpid()}-{time.time_ns()}")
    cookie.chmod(0o400)
    port, dist_port, epmd_port = free_port(), free_port(), free_port()
    config = folder / "rabbitmq.conf"
    config.write_text(
        "listeners.tcp = none\n"
        f"listeners.ssl.default = 127.0.0.1:{port}\n"
        f"ssl_options.cacertfile = {tls.ca}\n"
        f"ssl_options.certfile = {tls.cert}\n"
        f"ssl_options.keyfile = {tls.key}\n"
        "ssl_options.verify = verify_none\n"
        "ssl_options.fail_if_no_peer_cert = false\n"
    )
    (folder / "enabled_plugins").write_text("[].\n")
    (folder / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq's NODENAME
    env = dict(
        os.environ,
        HOME=str(home),
        RABBITMQ_NODENAME=f"outbox-tls-{port}@localhost",
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(free_port()),
        RABBITMQ_DIST_PORT=str(dist_port),
        RABBITMQ_CONF_ENV_FILE=str(folder / "rabbitmq-env.conf"),
        RABBITMQ_CONFIG_FILE=str(config),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(folder / "enabled_plugins"),
        RABBITMQ_MNESIA_BASE=str(folder / "mnesia"),
        RABBITMQ_LOG_BASE=str(folder / "log"),
        RABBITMQ_PID_FILE=str(folder / "rabbitmq.pid"),
        ERL_EPMD_PORT=str(epmd_port),
        ERL_EPMD_ADDRESS="127.0.0.1",
        ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}",
    )
    began = time.monotonic()
    epmd = spawn("epmd", [epmd_binary, "-port", str(epmd_port)], folder, env)
    try:
        epmd.wait_until(lambda: answers(epmd_port), began)
        began = time.monotonic()
        process = spawn("rabbitmq", [binary], folder, env)
        try:
            process.wait_until(lambda: _amqps_ready(port, tls), began)
            yield RabbitNode(port, process, tls, epmd)
        finally:
            process.stop()
    finally:
        epmd.stop()


def _amqps_ready(port: int, tls: Certificates) -> bool:
    """The node finished booting: an AMQP handshake over TLS goes through."""
    from kombu import Connection

    if not answers(port):
        return False
    connection = Connection(
        f"amqp://guest:guest@127.0.0.1:{port}//",
        ssl=amqp_tls(tls),
        connect_timeout=2,
    )
    try:
        connection.connect()
    except Exception:
        return False
    finally:
        connection.release()
    return True


def amqp_tls(tls: Certificates) -> dict[str, object]:
    """``broker_use_ssl`` for py-amqp: verify the server against the test's CA."""
    import ssl

    return {
        "ca_certs": str(tls.ca),
        "cert_reqs": ssl.CERT_REQUIRED,
        "server_hostname": "localhost",
    }


def redis_tls(tls: Certificates) -> dict[str, object]:
    """``broker_use_ssl`` for kombu's Redis transport: verify against the test's CA."""
    import ssl

    return {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tls.ca)}
