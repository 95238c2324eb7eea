"""Process-wide Monarch settings that must be in place before Monarch starts in a process.

Both the controller (through `forge.store`) and every host worker (`forge.worker`) apply
them, because the processes a worker spawns inherit the worker's environment, not the
controller's.
"""

import os

# Weights move between processes as Monarch messages: allow frames far larger than a model.
MAX_FRAME_LENGTH = "910737418240"

# Monarch's own variables naming the TLS files of its `tls://` transport (PEM paths).
TLS_ENV = {"ca": "HYPERACTOR_TLS_CA", "cert": "HYPERACTOR_TLS_CERT", "key": "HYPERACTOR_TLS_KEY"}


def set_frame_limit() -> None:
    # torchstore sets this itself when it is unset, but then also sets the root logger to
    # INFO and adds a stdout handler, which floods every forge program's output.
    os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", MAX_FRAME_LENGTH)


def set_tls_files(ca: str, cert: str, key: str) -> None:
    """Points Monarch's TLS transport at these files (checked to exist first)."""
    for kind, path in (("CA certificate", ca), ("certificate", cert), ("private key", key)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TLS {kind} file not found: {path}")
    os.environ.update({TLS_ENV["ca"]: ca, TLS_ENV["cert"]: cert, TLS_ENV["key"]: key})
    # Monarch reads its variables once, when it loads: make a process that already imported
    # it (the controller imports it with forge.controller) see the new ones.
    from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env

    reload_config_from_env()


def tls_files_from_env() -> dict[str, str] | None:
    """The TLS files named by Monarch's variables, or None when none is set."""
    files = {kind: os.environ.get(var) for kind, var in TLS_ENV.items()}
    if not any(files.values()):
        return None
    missing = [TLS_ENV[kind] for kind, path in files.items() if not path]
    if missing:
        raise ValueError(f"TLS needs all of {sorted(TLS_ENV.values())}; unset: {missing}")
    return files
