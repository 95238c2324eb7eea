"""A host worker: lends this machine to a forge controller on another one.

    python -m forge.worker --port 26600 --tls-ca ca.crt --tls-cert host.crt --tls-key host.key
    python -m forge.worker --port 26600 --insecure          # plain TCP, trusted networks only

It runs Monarch's worker loop and prints the address to list in the controller's
`provisioner.hosts`. A controller that attaches spawns its actors' processes here; they
inherit this process's environment (PYTHONPATH, CUDA_VISIBLE_DEVICES, ...), so start the
worker in the same software environment as the controller. When a controller disconnects,
the worker stops what it ran and waits for the next one.

TLS (mutual: the worker and the controller each present a certificate signed by the CA)
comes from the flags or, without them, from Monarch's variables HYPERACTOR_TLS_CA,
HYPERACTOR_TLS_CERT and HYPERACTOR_TLS_KEY. Without TLS files the worker refuses to start
unless `--insecure` is given: anyone who reaches an insecure worker's port can run code on it.
"""

from __future__ import annotations

import argparse
import socket
import sys

from forge import monarch_env


def worker_address(scheme: str, host: str, port: int, bind: str | None) -> str:
    """The address controllers dial; with `bind`, Monarch listens there instead (`dial@bind`)."""
    address = f"{scheme}://{host}:{port}"
    return f"{address}@{scheme}://{bind}:{port}" if bind else address


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m forge.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument(
        "--host",
        default=socket.getfqdn(),
        help="name or IP controllers use to reach this machine (default: its fully qualified name); "
        "with TLS it must be in the certificate's subject alternative names",
    )
    parser.add_argument("--bind", help="listen on this interface instead, e.g. 0.0.0.0")
    parser.add_argument("--tls-ca", help="CA certificate (PEM) that signed the controller's certificate")
    parser.add_argument("--tls-cert", help="this host's certificate (PEM)")
    parser.add_argument("--tls-key", help="this host's private key (PEM)")
    parser.add_argument("--insecure", action="store_true", help="plain TCP, no TLS")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: give a port between 1 and 65535")
    flags = [args.tls_ca, args.tls_cert, args.tls_key]
    if any(flags) and not all(flags):
        parser.error("give all three of --tls-ca, --tls-cert and --tls-key")
    try:
        files = dict(zip(("ca", "cert", "key"), flags, strict=True)) if all(flags) else None
        files = files or monarch_env.tls_files_from_env()
        if files:
            monarch_env.set_tls_files(**files)  # checks that the files exist
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    args.tls = files is not None
    if args.tls and args.insecure:
        parser.error("--insecure was given together with TLS files: choose one")
    if not args.tls and not args.insecure:
        parser.error(
            "no TLS files: give --tls-ca/--tls-cert/--tls-key (or set "
            f"{', '.join(monarch_env.TLS_ENV.values())}), or --insecure to accept plain TCP"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    monarch_env.set_frame_limit()  # inherited by the processes this worker spawns
    from monarch.actor import start_worker_loop_forever

    address = worker_address("tls" if args.tls else "tcp", args.host, args.port, args.bind)
    # Returns once the worker is listening, so the line below means "ready to attach".
    serving = start_worker_loop_forever(address=address, ca="trust_all_connections")
    # One write, so that Monarch's own start-up line cannot land inside it.
    sys.stdout.write(f"forge worker ready: attach with {address.split('@')[0]}\n")
    sys.stdout.flush()
    serving.get()


if __name__ == "__main__":
    sys.exit(main())
