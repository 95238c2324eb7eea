"""The W&B backend, offline: the run is written locally with the app's config in it.

wandb is an optional extra (`forge[wandb]`) and not in the default environment, so this
test is skipped there; install the extra to run it.
"""

import pytest

from forge.observability.backends import WandbBackend, WandbConfig

wandb = pytest.importorskip("wandb")


def test_offline_run_keeps_metrics_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    backend = WandbBackend(
        WandbConfig(project="forge-test", dir=str(tmp_path)), run_config={"trainer": {"lr": 0.001}}
    )
    assert backend._run.config["trainer"] == {"lr": 0.001}
    backend.log(0, {"eval/accuracy": 0.25})
    backend.log(1, {"rollout/reward": 0.5, "eval/accuracy": 0.5})
    backend.close()
    wandb.teardown()  # the wandb service process finishes writing the run file
    (offline,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # The run's records (protobuf) name the config and both metric keys.
    written = offline.read_bytes()
    assert b"trainer" in written and b"eval/accuracy" in written and b"rollout/reward" in written
