"""Transport security and access control against the real kvsparse-server: TLS, mutual TLS,
certificate reload without a restart, bearer tokens with roles, the refusal to serve a
non-loopback address in clear text, and a split deployment whose worker reaches its store over
mutual TLS with a token. Certificates are made here with the openssl command-line tool."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import kvsparse

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl tool")

SHAPE = kvsparse.ModelShape(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="fp32")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
             "-days", "2", "-subj", f"/CN={name}")
    return crt, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], server: bool) -> tuple[Path, Path]:
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(crt), "-days", "2", "-extfile", str(ext))
    return crt, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("pki")
    ca1, ca2 = _ca(d, "ca1"), _ca(d, "ca2")
    return {
        "ca1": ca1,
        "ca2": ca2,
        "server1": _leaf(d, "server1", ca1, server=True),
        "server2": _leaf(d, "server2", ca2, server=True),
        "client1": _leaf(d, "client1", ca1, server=False),
        "client2": _leaf(d, "client2", ca2, server=False),
    }


def _roundtrip(client: kvsparse.Client, seq: str = "s") -> None:
    client.store.create_sequence(seq, SHAPE)
    k = np.random.default_rng(0).standard_normal((1, 8, 2, 64), dtype=np.float32)
    client.store.append(seq, k, k)
    q = np.ones((1, 4, 64), np.float32)
    r = client.attention.decode(0, [seq], q, kvsparse.Dense())
    assert r.output.shape == (1, 4, 64)
    client.store.drop_sequence(seq)


def _wait_served(server: kvsparse.LocalServer, creds: kvsparse.Credentials, timeout: float = 20.0) -> None:
    """Until a client with `creds` gets through (the server re-reads its certificate files), a
    round trip at most `timeout` seconds from now."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with kvsparse.Client(server.target, credentials=creds, timeout=3) as c:
                _roundtrip(c, "served")
            return
        except kvsparse.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_tls_and_plaintext_refused(pki: dict[str, tuple[Path, Path]]) -> None:
    cert, key = pki["server1"]
    tls = kvsparse.Credentials(ca=str(pki["ca1"][0]))
    with kvsparse.LocalServer(gpu="off", tls_cert=cert, tls_key=key, credentials=tls) as server:
        with kvsparse.Client(server.target, credentials=tls, timeout=10) as c:
            _roundtrip(c)
        with kvsparse.Client(server.target, timeout=3) as plain, pytest.raises(kvsparse.Unavailable):
            plain.store.list_sequences()
        other_ca = kvsparse.Credentials(ca=str(pki["ca2"][0]))  # does not sign the server's cert
        with kvsparse.Client(server.target, credentials=other_ca, timeout=3) as c, pytest.raises(kvsparse.Unavailable):
            c.store.list_sequences()


def test_mutual_tls(pki: dict[str, tuple[Path, Path]]) -> None:
    cert, key = pki["server1"]
    ca = str(pki["ca1"][0])
    ok = kvsparse.Credentials(ca=ca, cert=str(pki["client1"][0]), key=str(pki["client1"][1]))
    with kvsparse.LocalServer(gpu="off", tls_cert=cert, tls_key=key, tls_client_ca=ca, credentials=ok) as server:
        with kvsparse.Client(server.target, credentials=ok, timeout=10) as c:
            _roundtrip(c)
        for bad in (
            kvsparse.Credentials(ca=ca),  # no client certificate
            kvsparse.Credentials(ca=ca, cert=str(pki["client2"][0]), key=str(pki["client2"][1])),  # other CA
        ):
            with kvsparse.Client(server.target, credentials=bad, timeout=3) as c, pytest.raises(kvsparse.Unavailable):
                c.store.list_sequences()


def test_cli_names_the_handshake_failure(pki: dict[str, tuple[Path, Path]]) -> None:
    # The CLI trusting another CA: it says why it could not connect (before: only "could not
    # connect ... within 2s", while the Python client showed the handshake error).
    cli = Path(kvsparse.grpc.local_server.find_server_binary()).parent / "kvsparse"
    if not cli.exists():
        pytest.skip("no kvsparse CLI beside the server binary")
    first = kvsparse.Credentials(ca=str(pki["ca1"][0]))
    with kvsparse.LocalServer(gpu="off", tls_cert=pki["server1"][0], tls_key=pki["server1"][1], credentials=first) as s:
        run = subprocess.run([str(cli), f"--target={s.target}", f"--tls_ca={pki['ca2'][0]}", "--wait_for_ready=2s",
                              "health"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "could not connect" in last and "certificate verify failed" in last, run.stderr


def test_certificate_reload_without_restart(pki: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    # The server starts with a certificate of CA 1; the client trusts CA 2 only. Replacing the
    # files with CA 2's certificate lets the client in after the next re-read (--tls_reload=1s).
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    shutil.copy(pki["server1"][0], cert)
    shutil.copy(pki["server1"][1], key)
    first = kvsparse.Credentials(ca=str(pki["ca1"][0]))
    second = kvsparse.Credentials(ca=str(pki["ca2"][0]))
    with kvsparse.LocalServer(gpu="off", tls_cert=cert, tls_key=key, tls_reload="1s", credentials=first) as server:
        with kvsparse.Client(server.target, credentials=second, timeout=3) as c, pytest.raises(kvsparse.Unavailable):
            c.store.list_sequences()
        # Key first, then certificate: the watcher reads both; a half-written pair is retried.
        shutil.copy(pki["server2"][1], key)
        shutil.copy(pki["server2"][0], cert)
        _wait_served(server, second)
        assert server.process is not None and server.process.poll() is None, "no restart"


def _wait_log(server: kvsparse.LocalServer, text: str, count: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while server.log().count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log()[-2000:]}"
        time.sleep(0.2)


def test_bad_certificate_on_reload_keeps_the_last_good_one(pki: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    # Replacing the certificate with garbage, or with a certificate that is not the key's, is
    # refused (logged, counted): new connections keep getting the last good pair. Before, gRPC
    # served the bad files and every new handshake failed until good ones returned.
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    shutil.copy(pki["server1"][0], cert)
    shutil.copy(pki["server1"][1], key)
    first = kvsparse.Credentials(ca=str(pki["ca1"][0]))
    second = kvsparse.Credentials(ca=str(pki["ca2"][0]))
    with kvsparse.LocalServer(
        gpu="off", tls_cert=cert, tls_key=key, tls_reload="1s", credentials=first, log_level="info"
    ) as server:
        cert.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
        _wait_log(server, "keeping the last good certificate and key")
        time.sleep(1.5)  # gRPC re-reads its copies every second: they must still be the good pair
        with kvsparse.Client(server.target, credentials=first, timeout=5) as c:
            _roundtrip(c, "after-garbage")
        shutil.copy(pki["server2"][0], cert)  # CA 2's certificate with CA 1's key: no pair
        _wait_log(server, "the private key is not the certificate's")
        time.sleep(1.5)
        with kvsparse.Client(server.target, credentials=first, timeout=5) as c:
            _roundtrip(c, "after-mismatch")
        shutil.copy(pki["server2"][1], key)  # now the pair matches: applied
        _wait_log(server, "new certificate files applied")
        _wait_served(server, second)
        assert server.log().count("keeping the last good certificate and key") == 2, "each refusal logged once"


def test_bearer_tokens_and_roles(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# token role\nreader-0123456789abcdef read\nwriter-0123456789abcdef write\n")
    with kvsparse.LocalServer(gpu="off", auth_tokens=tokens) as server:
        writer = kvsparse.Credentials(token="writer-0123456789abcdef")
        reader = kvsparse.Credentials(token="reader-0123456789abcdef")
        with kvsparse.Client(server.target, credentials=writer, timeout=10) as w:
            _roundtrip(w, "a")
            w.store.create_sequence("kept", SHAPE)
            k = np.ones((1, 4, 2, 64), np.float32)
            w.store.append("kept", k, k)
        with kvsparse.Client(server.target, credentials=reader, timeout=10) as r:
            assert [i.sequence_id for i in r.store.list_sequences()] == ["kept"]
            r.attention.decode(0, ["kept"], np.ones((1, 4, 64), np.float32), kvsparse.Dense())
            with pytest.raises(kvsparse.PermissionDenied, match="Append needs a token with role write"):
                r.store.append("kept", k, k)
            with pytest.raises(kvsparse.PermissionDenied):
                r.store.drop_sequence("kept")
        with kvsparse.Client(server.target, timeout=10) as anonymous:
            assert anonymous.store.health() == "SERVING"  # probes need no token
            with pytest.raises(kvsparse.Unauthenticated, match="requires a bearer token"):
                anonymous.store.list_sequences()
        bad = kvsparse.Credentials(token="not-a-known-token-0000")
        with kvsparse.Client(server.target, credentials=bad, timeout=10) as c:
            with pytest.raises(kvsparse.Unauthenticated, match="unknown bearer token"):
                c.store.list_sequences()
            with pytest.raises(kvsparse.Unauthenticated):  # streams too
                with c.attention.stream() as s:
                    s.decode(0, ["kept"], np.ones((1, 4, 64), np.float32), kvsparse.Dense())


def test_tenants_see_only_their_sequences(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-0123456789abcdef write alice\nbob-0123456789abcdefgh write bob\n"
                      "bob-reader-0123456789ab read bob\nops-0123456789abcdefgh admin\n")
    k = np.random.default_rng(1).standard_normal((1, 8, 2, 64), dtype=np.float32)
    q = np.ones((1, 4, 64), np.float32)
    with kvsparse.LocalServer(gpu="off", auth_tokens=tokens) as server:
        def client(token: str) -> kvsparse.Client:
            return kvsparse.Client(server.target, credentials=kvsparse.Credentials(token=token), timeout=10)

        with client("alice-0123456789abcdef") as alice, client("bob-0123456789abcdefgh") as bob, \
                client("bob-reader-0123456789ab") as bob_reader, client("ops-0123456789abcdefgh") as ops:
            for c, scale in ((alice, 1.0), (bob, -1.0)):  # the same id in both tenants
                c.store.create_sequence("s", SHAPE)
                c.store.append("s", k, scale * k)  # V negated in bob's
            assert [i.sequence_id for i in alice.store.list_sequences()] == ["s"]
            assert alice.store.sequence_info("s").sequence_id == "s"
            a = alice.attention.decode(0, ["s"], q, kvsparse.Dense()).output
            b = bob_reader.attention.decode(0, ["s"], q, kvsparse.Dense()).output
            np.testing.assert_allclose(a, -b, rtol=1e-6)  # each saw its own rows
            g = bob_reader.store.gather("s", 0, [0], kv_heads=[0])
            np.testing.assert_array_equal(g.v[0], -k[0, 0, 0])
            with pytest.raises(kvsparse.NotFound) as e:
                alice.store.sequence_info("bob:s")  # no way into another tenant's namespace
            assert "'bob:s'" in str(e.value) and "alice:" not in str(e.value)  # her id, not the store's
            with pytest.raises(kvsparse.NotFound) as e:
                alice.attention.decode(0, ["gone"], q, kvsparse.Dense())
            assert "'gone'" in str(e.value) and "alice:" not in str(e.value)
            assert sorted(i.sequence_id for i in ops.store.list_sequences()) == ["alice:s", "bob:s"]
            # A fork stays in its tenant: both ids are the caller's.
            with pytest.raises(kvsparse.NotFound) as e:
                alice.store.fork_sequence("bob:s", "mine", 4)
            assert "alice:" not in str(e.value)
            alice.store.fork_sequence("s", "s-fork", 4)
            assert sorted(i.sequence_id for i in ops.store.list_sequences()) == ["alice:s", "alice:s-fork", "bob:s"]
            with pytest.raises(kvsparse.PermissionDenied):
                bob_reader.store.fork_sequence("s", "t", 4)  # a write
            alice.store.drop_sequence("s-fork")
            # Statistics: a tenant sees its own sequences and bytes, no store-wide traffic; the
            # untenanted admin, the whole store (before: every tenant saw the whole store).
            bob.store.create_sequence("t", SHAPE)
            mine, whole = bob.store.stats(), ops.store.stats()
            assert (mine.num_sequences, whole.num_sequences) == (2, 3)
            assert mine.bytes_used == bob.store.sequence_info("s").bytes_used + bob.store.sequence_info("t").bytes_used
            assert whole.bytes_used > mine.bytes_used and whole.rows_appended > 0
            assert mine.rows_appended == mine.rows_gathered == mine.evictions == 0
            assert mine.capacity_bytes == whole.capacity_bytes
            bob.store.drop_sequence("t")
            ops.store.drop_sequence("bob:s")  # admin: drop of another's sequence
            assert bob.store.list_sequences() == []
            assert [i.sequence_id for i in alice.store.list_sequences()] == ["s"]


def test_refuses_clear_text_beyond_loopback(tmp_path: Path) -> None:
    binary = kvsparse.grpc.local_server.find_server_binary()
    run = subprocess.run([binary, "--listen=0.0.0.0:0", "--metrics_listen=", "--gpu=off"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert "without TLS" in run.stderr and "--insecure" in run.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("short read\n")
    run = subprocess.run([binary, f"--auth_tokens={tokens}", "--metrics_listen=", "--gpu=off"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode != 0 and "16..512 characters" in run.stderr


def test_split_deployment_over_mutual_tls_with_a_token(pki: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    ca = str(pki["ca1"][0])
    tokens = tmp_path / "tokens"
    tokens.write_text("worker-token-0123456789 read\nclient-token-0123456789 write\n")
    worker_token = tmp_path / "worker.token"
    worker_token.write_text("worker-token-0123456789\n")
    client = kvsparse.Credentials(ca=ca, cert=str(pki["client1"][0]), key=str(pki["client1"][1]),
                                  token="client-token-0123456789")
    server_tls = {"tls_cert": pki["server1"][0], "tls_key": pki["server1"][1], "tls_client_ca": ca}
    with kvsparse.LocalServer(gpu="off", role="store", auth_tokens=tokens, credentials=client, **server_tls) as store:
        worker_flags = {"role": "worker", "store": store.target, "store_tls_ca": ca,
                        "store_tls_cert": pki["client1"][0], "store_tls_key": pki["client1"][1],
                        "store_token_file": worker_token}
        with kvsparse.LocalServer(gpu="off", credentials=client, **worker_flags, **server_tls) as worker:
            with kvsparse.Client(worker.target, store_target=store.target, credentials=client, timeout=10) as c:
                _roundtrip(c)
        # Without the token the store refuses the worker: the deployment's fault, said so.
        del worker_flags["store_token_file"]
        with kvsparse.LocalServer(gpu="off", credentials=client, **worker_flags, **server_tls) as worker:
            with kvsparse.Client(worker.target, store_target=store.target, credentials=client, timeout=10) as c:
                c.store.create_sequence("s", SHAPE)
                k = np.ones((1, 4, 2, 64), np.float32)
                c.store.append("s", k, k)
                with pytest.raises(kvsparse.Internal, match="the store refused this worker"):
                    c.attention.decode(0, ["s"], np.ones((1, 4, 64), np.float32), kvsparse.Dense())


def test_inprocess_engine_over_a_store_with_mutual_tls_and_a_token(
    pki: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The op's engine (kvsparse.torch.ops) reaches a store that serves mutual TLS and asks for
    tokens as a worker does (rpc/store_connection.h): sequences created and appended there, rows
    read back over Gather, the output dense attention's; without the token, or in clear text, the
    store refuses it."""
    torch = pytest.importorskip("torch")
    from kvsparse.torch import ops

    if not ops.available():
        pytest.skip("libkvsparse_torch.so not built")
    ca = str(pki["ca1"][0])
    tokens = tmp_path / "tokens"
    tokens.write_text("op-token-0123456789 write\n")
    creds = kvsparse.Credentials(ca=ca, cert=str(pki["client1"][0]), key=str(pki["client1"][1]),
                                 token="op-token-0123456789")
    server_tls = {"tls_cert": pki["server1"][0], "tls_key": pki["server1"][1], "tls_client_ca": ca}
    shape = kvsparse.ModelShape(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="fp32")
    with kvsparse.LocalServer(gpu="off", role="store", auth_tokens=tokens, credentials=creds, **server_tls) as store:
        with ops.InProcessEngine(gpu="off", store=store.target, store_credentials=creds) as engine:
            engine.create_sequence("s", shape)
            k, v = torch.randn(16, 2, 64), torch.randn(16, 2, 64)
            engine.append("s", 0, k, v)
            assert engine.layer_lengths("s") == [16]
            q = torch.randn(1, 4, 64)
            out, _ = engine.decode(0, ["s"], q)
            kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # [16, 4, 64]
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], kk) / 8.0, dim=-1)
            assert torch.allclose(out[0], torch.einsum("hn,nhd->hd", p, vv), atol=1e-5)
            engine.drop_sequence("s")
        no_token = kvsparse.Credentials(ca=creds.ca, cert=creds.cert, key=creds.key)
        with ops.InProcessEngine(gpu="off", store=store.target, store_credentials=no_token) as engine:
            with pytest.raises(kvsparse.Unauthenticated, match="requires a bearer token"):
                engine.create_sequence("t", shape)
        with ops.InProcessEngine(gpu="off", store=store.target) as engine:  # clear text
            with pytest.raises(kvsparse.KvSparseError):
                engine.create_sequence("t", shape)
    with pytest.raises(ValueError, match="store='host:port'"):
        ops.InProcessEngine(gpu="off", store_credentials=creds)
