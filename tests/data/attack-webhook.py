#!/usr/bin/env python3
"""A hostile client of initium's webhook port (loopback only), for tests/faults.rs.

    attack.py HOST:PORT [--connections N] [--kinds N] [--validations N]

Each attack once grew initium's memory without bound (docs/reliability.md):
- N connections that announce a 7 MiB body, send 1 MiB of it and stall;
- N AdmissionReviews, each of a different kind (metric labels);
- N concurrent /validate posts of a 60 KB rule with 1,000 `\\w{20}` regexes.
Every loop is bounded in count and time. Prints one JSON line: what each attack got back.
"""
import json
import socket
import ssl
import sys
import threading
import time


def connect(addr):
    host, port = addr.rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection((host, int(port)), timeout=10)
    return context.wrap_socket(raw)


def request(sock, path, body):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: initium\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    status = int(head.split()[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status


def stalled_bodies(addr, count, hold, out):
    socks, refused = [], 0
    for _ in range(count):
        try:
            s = connect(addr)
            s.sendall(
                b"POST /mutate HTTP/1.1\r\nHost: initium\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {7 << 20}\r\n\r\n".encode()
            )
            s.sendall(b"[" + b"0," * (1 << 19))
            socks.append(s)
        except OSError:
            refused += 1
    time.sleep(hold)
    for s in socks:
        try:
            s.close()
        except OSError:
            pass
    out["stalled"] = {"held": len(socks), "refused": refused}


def review(kind, n):
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": f"u{n}",
                "kind": {"group": "attack.example.com", "version": "v1", "kind": kind},
                "resource": {"group": "attack.example.com", "version": "v1", "resource": "x"},
                "operation": "CREATE",
                "namespace": "default",
                "name": f"x{n}",
                "object": {"apiVersion": "attack.example.com/v1", "kind": kind,
                           "metadata": {"name": f"x{n}", "namespace": "default"}},
                "userInfo": {"username": "attacker"},
            },
        }
    ).encode()


def distinct_kinds(addr, count, workers, out):
    statuses = {}
    lock = threading.Lock()
    deadline = time.monotonic() + 120

    def work(start):
        sock = None
        for n in range(start, count, workers):
            if time.monotonic() > deadline:
                break
            try:
                sock = sock or connect(addr)
                status = request(sock, "/mutate", review(f"Kind{n}", n))
            except OSError:
                sock, status = None, "error"
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["kinds"] = {str(k): v for k, v in statuses.items()}


def validations(addr, count, out):
    rule = {
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "regexes", "namespace": "default"},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "conditions": [{"path": "$.metadata.name", "matches": "\\w{20}"}] * 1000,
            "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}],
        },
    }
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "v",
                "kind": {"group": "initium.dev", "version": "v1alpha1", "kind": "MutationRule"},
                "resource": {"group": "initium.dev", "version": "v1alpha1", "resource": "mutationrules"},
                "operation": "CREATE",
                "namespace": "default",
                "name": "regexes",
                "object": rule,
                "userInfo": {"username": "attacker"},
            },
        }
    ).encode()
    statuses = {}
    lock = threading.Lock()
    started = time.monotonic()

    def work():
        try:
            status = request(connect(addr), "/validate", body)
        except OSError:
            status = "error"
        with lock:
            statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=work) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["validations"] = {
        "statuses": {str(k): v for k, v in statuses.items()},
        "seconds": round(time.monotonic() - started, 2),
        "body_bytes": len(body),
    }


def main():
    args = sys.argv[1:]
    addr = args[0]
    opts = dict(zip(args[1::2], args[2::2]))
    out = {}
    stall = threading.Thread(
        target=stalled_bodies, args=(addr, int(opts.get("--connections", 200)), 5, out)
    )
    stall.start()
    distinct_kinds(addr, int(opts.get("--kinds", 5000)), 4, out)
    validations(addr, int(opts.get("--validations", 20)), out)
    stall.join()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
