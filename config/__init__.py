"""Typed, validated configuration: hardware, models, links, empirical profiles, cluster specs."""

from config.catalog import PRESETS_DIR, Catalog, Registry, default_catalog
from config.cluster import (
    ROLES,
    ClusterSpec,
    EngineGroupSpec,
    EngineInstance,
    NodeSpec,
    RegionSpec,
    RouterSpec,
    SchedulerSpec,
    TransportSpec,
    WanLinkSpec,
    load_cluster,
)
from config.errors import ConfigError
from config.hardware import Efficiency, HardwareProfile
from config.link import LinkProfile
from config.model import MLASpec, ModelProfile, MoESpec
from config.profile import EmpiricalProfile

__all__ = [
    "PRESETS_DIR",
    "ROLES",
    "Catalog",
    "ClusterSpec",
    "ConfigError",
    "Efficiency",
    "EmpiricalProfile",
    "EngineGroupSpec",
    "EngineInstance",
    "HardwareProfile",
    "LinkProfile",
    "MLASpec",
    "MoESpec",
    "ModelProfile",
    "NodeSpec",
    "RegionSpec",
    "Registry",
    "RouterSpec",
    "SchedulerSpec",
    "TransportSpec",
    "WanLinkSpec",
    "default_catalog",
    "load_cluster",
]
