"""Actors, proc meshes and services: how forge places and supervises its components."""

from forge.controller.actor import ForgeActor
from forge.controller.provisioner import (
    Provisioner,
    ProvisionerConfig,
    get_provisioner,
    init_provisioner,
    shutdown,
)
from forge.controller.service import NoHealthyReplicaError, ReplicaFailedError, Service

__all__ = [
    "ForgeActor",
    "NoHealthyReplicaError",
    "Provisioner",
    "ProvisionerConfig",
    "ReplicaFailedError",
    "Service",
    "get_provisioner",
    "init_provisioner",
    "shutdown",
]
