"""Where Monarch's failure reports go: a mesh stopped on purpose is no failure of anything in
use, so its late report neither stops the program nor reaches the run's handler."""

import pytest

from forge.controller import supervision


class Report:
    """The two things the hook reads of Monarch's `MeshFailure`."""

    def __init__(self, mesh_name: str):
        self.mesh_name = mesh_name

    def report(self) -> str:
        return f"{self.mesh_name}: process exited with SIGTERM"


@pytest.fixture
def unrecoverable():
    seen: list[str] = []
    supervision.on_unrecoverable(lambda actor, report: seen.append(actor))
    yield seen
    supervision.on_unrecoverable(None)


def test_a_mesh_stopped_on_purpose_is_only_logged(unrecoverable, caplog):
    supervision.remember_name("Probe_41")
    supervision.stopped_on_purpose("Probe_41")
    with caplog.at_level("INFO", logger="forge.controller.supervision"):
        supervision._fault_hook(Report("probe_41-a1b2c3"))
    assert unrecoverable == []
    assert "stopped on purpose" in caplog.text


def test_a_mesh_in_use_still_reaches_the_handler(unrecoverable):
    supervision.remember_name("Probe_42")
    supervision._fault_hook(Report("probe_42-a1b2c3"))
    assert unrecoverable == ["Probe_42"]


def test_a_stopped_replica_no_longer_reaches_its_service():
    replaced: list[str] = []
    supervision.register("Probe_43", replaced.append)
    supervision._fault_hook(Report("probe_43-a1b2c3"))
    supervision.stopped_on_purpose("Probe_43")
    supervision._fault_hook(Report("probe_43-a1b2c3"))  # would exit the program before
    assert len(replaced) == 1


def test_without_a_handler_a_mesh_in_use_stops_the_program():
    supervision.on_unrecoverable(None)
    with pytest.raises(SystemExit):
        supervision._fault_hook(Report("probe_44-a1b2c3"))
